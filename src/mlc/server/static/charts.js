// Line charts on a <canvas>, sized for the device pixel ratio and redrawn when their box changes size.
// A series is {label, color, points: [[x, y], ...], width, alpha, dash, dots}; a null y leaves a gap.
// The legend is real text under the canvas, and the canvas carries an aria-label the page keeps current.
"use strict";
window.MLC = window.MLC || {};

(function (MLC) {
  MLC.COLORS = ["#2f6fde", "#e8590c", "#2b9348", "#9c36b5", "#c92a2a", "#0b7285"];

  function niceStep(range, target) {
    const raw = range / Math.max(target, 1), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  }

  function ticks(lo, hi, target, fixedStep) {
    if (!(hi > lo)) return [lo];
    const step = fixedStep || niceStep(hi - lo, target), out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }

  function shortNum(v) {
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6) return (v / 1e6).toFixed(1).replace(/\.0$/, "") + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(a >= 10 ? 1 : 2).replace(/\.?0+$/, "");
    if (a >= 0.001) return v.toPrecision(2).replace(/\.?0+$/, "");
    return v.toExponential(0);
  }

  class Chart {
    constructor(canvas, opts) {
      this.canvas = canvas;
      this.opts = Object.assign({ yFormat: shortNum, xFormat: shortNum, yMin: null, yMax: null, xTicks: 6 }, opts);
      this.series = [];
      this.legend = opts && opts.legend ? document.getElementById(opts.legend) : null;
      if (window.ResizeObserver) new ResizeObserver(() => this.draw()).observe(canvas);
    }

    set(series, xRange) {
      this.series = series;
      this.xRange = xRange || null;
      this.draw();
      this.drawLegend();
    }

    drawLegend() {
      if (!this.legend) return;
      const key = this.series.map((s) => s.label + s.color + (s.dash ? "d" : "")).join("|");
      if (key === this.legendKey) return;
      this.legendKey = key;
      this.legend.textContent = "";
      for (const s of this.series) {
        if (s.noLegend) continue;
        const li = document.createElement("li"), sw = document.createElement("span");
        sw.className = "swatch" + (s.dash ? " dashed" : "") + (s.dotsOnly || (s.dots && !s.points.length) ? " dot" : "");
        sw.style.borderColor = s.color;
        if (s.dotsOnly) sw.style.background = s.color;
        li.appendChild(sw);
        li.appendChild(document.createTextNode(s.label));
        this.legend.appendChild(li);
      }
    }

    bounds() {
      let xlo = Infinity, xhi = -Infinity, ylo = Infinity, yhi = -Infinity;
      for (const s of this.series) for (const [x, y] of s.points) {
        if (x === null || y === null || !isFinite(y)) continue;
        xlo = Math.min(xlo, x); xhi = Math.max(xhi, x); ylo = Math.min(ylo, y); yhi = Math.max(yhi, y);
      }
      if (this.xRange) [xlo, xhi] = this.xRange;
      if (this.opts.yMin !== null) ylo = Math.min(this.opts.yMin, ylo === Infinity ? this.opts.yMin : ylo);
      if (this.opts.yMax !== null) yhi = Math.max(this.opts.yMax, yhi === -Infinity ? this.opts.yMax : yhi);
      if (ylo === Infinity) { ylo = 0; yhi = 1; }
      if (yhi - ylo < 1e-12) { const pad = Math.abs(yhi) * 0.1 || 1; ylo -= this.opts.yMin === ylo ? 0 : pad; yhi += pad; }
      else if (this.opts.yMin === null) { const pad = (yhi - ylo) * 0.06; ylo -= pad; yhi += pad; }
      else yhi += (yhi - ylo) * 0.06;
      if (!(xhi > xlo)) { xhi = (xlo === Infinity ? 1 : xlo + 1); xlo = xlo === Infinity ? 0 : xlo; }
      return { xlo, xhi, ylo, yhi };
    }

    draw() {
      const c = this.canvas, dpr = window.devicePixelRatio || 1;
      const w = c.clientWidth, h = c.clientHeight;
      if (!w || !h) return;
      if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
        c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
      }
      const ctx = c.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      const style = getComputedStyle(c);
      const ink = style.getPropertyValue("--muted").trim() || "#666", grid = style.getPropertyValue("--line").trim() || "#ddd";
      ctx.font = "11px system-ui, sans-serif";
      const b = this.bounds();
      const yn = Math.max(2, Math.floor(h / 45));
      const yt = ticks(b.ylo, b.yhi, yn, this.opts.integer ? Math.max(1, niceStep(b.yhi - b.ylo, yn)) : 0);
      const left = 8 + Math.max(...yt.map((v) => ctx.measureText(this.opts.yFormat(v)).width), 10);
      const pad = { l: left, r: 10, t: 8, b: 22 };
      const X = (x) => pad.l + ((x - b.xlo) / (b.xhi - b.xlo)) * (w - pad.l - pad.r);
      const Y = (y) => h - pad.b - ((y - b.ylo) / (b.yhi - b.ylo)) * (h - pad.t - pad.b);
      ctx.strokeStyle = grid; ctx.fillStyle = ink; ctx.lineWidth = 1;
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      for (const v of yt) {
        const y = Math.round(Y(v)) + 0.5;
        if (y < pad.t - 1 || y > h - pad.b + 1) continue;
        ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
        ctx.fillText(this.opts.yFormat(v), pad.l - 5, y);
      }
      ctx.textAlign = "center"; ctx.textBaseline = "top";
      const xn = Math.max(2, Math.min(this.opts.xTicks, Math.floor(w / 80)));
      const xt = this.opts.xStep ? ticks(b.xlo, b.xhi, 0, this.opts.xStep(b.xhi - b.xlo, xn)) : ticks(b.xlo, b.xhi, xn);
      for (const v of xt) { // keep the first and last labels inside the canvas
        const label = this.opts.xFormat(v), half = ctx.measureText(label).width / 2;
        ctx.fillText(label, Math.min(Math.max(X(v), half + 1), w - half - 1), h - pad.b + 5);
      }
      ctx.save();
      ctx.beginPath(); ctx.rect(pad.l, pad.t - 2, w - pad.l - pad.r, h - pad.t - pad.b + 4); ctx.clip();
      for (const s of this.series) this.drawSeries(ctx, s, X, Y, { top: pad.t, bottom: h - pad.b });
      ctx.restore();
      if (!this.series.some((s) => s.points.some((p) => p[1] !== null))) {
        ctx.textAlign = "center"; ctx.textBaseline = "middle"; ctx.fillStyle = ink;
        ctx.fillText(this.opts.empty || "no data yet", (pad.l + w - pad.r) / 2, (pad.t + h - pad.b) / 2);
      }
    }

    drawSeries(ctx, s, X, Y, area) {
      ctx.strokeStyle = s.color; ctx.fillStyle = s.color;
      ctx.globalAlpha = s.alpha === undefined ? 1 : s.alpha;
      ctx.lineWidth = s.width || 1.8;
      ctx.setLineDash(s.dash ? [5, 4] : []);
      if (!s.dotsOnly) {
        ctx.beginPath();
        const pts = s.points, ok = (k) => k >= 0 && k < pts.length && pts[k][1] !== null && isFinite(pts[k][1]);
        for (let k = 0; k < pts.length; k++) {
          if (!ok(k)) continue;
          const [x, y] = pts[k];
          if (ok(k - 1)) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
          if (!ok(k - 1) && !ok(k + 1)) ctx.arc(X(x), Y(y), 1.5, 0, 2 * Math.PI); // a lone point: a dot, not nothing
        }
        ctx.stroke();
      }
      if (s.dots || s.dotsOnly) {
        for (const [x, y] of s.points) {
          if (y === null || !isFinite(y)) continue;
          ctx.beginPath(); ctx.arc(X(x), Y(y), s.radius || 3, 0, 2 * Math.PI); ctx.fill();
        }
      }
      if (s.marks) { // vertical ticks at these x (skipped steps)
        ctx.globalAlpha = 0.8; ctx.lineWidth = 1.5; ctx.setLineDash([2, 2]);
        for (const x of s.marks) { ctx.beginPath(); ctx.moveTo(X(x), area.top); ctx.lineTo(X(x), area.bottom); ctx.stroke(); }
      }
      ctx.globalAlpha = 1; ctx.setLineDash([]);
    }
  }

  MLC.Chart = Chart;
  MLC.shortNum = shortNum;
})(window.MLC);
