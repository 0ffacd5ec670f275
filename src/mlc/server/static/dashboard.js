// The live dashboard: polls GET /api/metrics every second (only the history samples it has not seen yet) and
// redraws the tiles and charts. Up to ten minutes of one-second samples are kept by the server.
"use strict";

(function (MLC) {
  const $ = MLC.$, fmt = MLC.fmt, C = MLC.COLORS;
  const samples = [];
  let lastTime = null, paused = false, charts = null, serverNow = null, inFlight = false;

  function setText(id, text) { const el = $(id); if (el.textContent !== text) el.textContent = text; }
  const triple = (p) => [p.p50, p.p90, p.p99].map(fmt.ms).join(" · ");

  function mean(rows, key, seconds) {
    const cutoff = serverNow - seconds;
    const vals = rows.filter((r) => r.t > cutoff && r[key] !== null).map((r) => r[key]);
    return vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : null;
  }

  function tiles(snap) {
    const now = snap.now;
    if (!now) {
      for (const id of ["tile-running", "tile-waiting", "tile-kv", "tile-prefix", "tile-tps"]) setText(id, "–");
      setText("tile-kv-sub", snap.status === "loading" ? "model loading" : snap.status);
    } else {
      setText("tile-running", String(now.running));
      setText("tile-waiting", String(now.waiting));
      setText("tile-kv", fmt.pct(now.kv_cache_usage));
      $("bar-kv").style.width = Math.min(100, now.kv_cache_usage * 100).toFixed(1) + "%";
      setText("tile-kv-sub", (now.kv_pages_total - now.kv_pages_free) + " of " + now.kv_pages_total + " pages");
      setText("tile-prefix", fmt.pct(now.prefix_cache_hit_rate));
      const lastMin = mean(samples, "prefix_hit_rate", 60);
      setText("tile-prefix-sub", "since start; last minute " + fmt.pct(lastMin));
      const finished = Object.values(now.requests_finished).reduce((a, b) => a + b, 0);
      const rejected = Object.values(now.requests_rejected).reduce((a, b) => a + b, 0);
      setText("tile-finished", String(finished));
      const aborted = now.requests_finished.abort || 0;
      setText("tile-finished-sub", "finished; " + aborted + " stopped, " + rejected + " refused, " + now.preemptions +
        " preempted");
    }
    const gen = mean(samples, "generation_tps", 10), prompt = mean(samples, "prompt_tps", 10);
    setText("tile-tps", fmt.num(gen, 1));
    const drafts = snap.now && snap.now.spec_acceptance_rate != null
      ? "; drafts " + fmt.pct(snap.now.spec_acceptance_rate) + " accepted, " +
        fmt.num(snap.now.spec_mean_accepted_length, 2) + " tokens/step" : "";
    setText("tile-tps-sub", "generated, last 10 s; prompt " + fmt.num(prompt, 0) + drafts);
    const lat = snap.latency;
    setText("tile-ttft", fmt.ms(lat.ttft_s.p50));
    setText("tile-ttft-sub", "p50 · p90 · p99: " + triple(lat.ttft_s));
    setText("tile-tpot", fmt.ms(lat.tpot_s.p50));
    setText("tile-tpot-sub", "p50 · p90 · p99: " + triple(lat.tpot_s));
    setText("latency-note", "Latency percentiles cover the " + lat.requests + " request(s) finished in the last " +
      Math.round(lat.window_s / 60) + " minutes.");
  }

  function series(key, label, color, scale, extra) {
    return Object.assign({ label, color, points: samples.map((r) => [r.t - serverNow, r[key] === null ? null : r[key] * (scale || 1)]) }, extra || {});
  }

  function drawCharts() {
    if (!charts || serverNow === null) return;
    // a young server has less history than the window: zoom to what there is (at least a minute)
    const have = samples.length ? serverNow - samples[0].t : 0;
    const span = Math.min(Number($("window").value), Math.max(60, Math.ceil(have / 60) * 60)), range = [-span, 0];
    charts.tps.set([series("generation_tps", "generated", C[0]), series("prompt_tps", "prompt", C[1], 1, { width: 1.2 })], range);
    charts.req.set([series("running", "running", C[0]), series("waiting", "waiting", C[1])], range);
    charts.kv.set([series("kv_cache_usage", "KV-cache usage", C[2], 100),
                   series("prefix_hit_rate", "prefix-cache hit rate", C[3], 100, { dots: true, radius: 2 })], range);
    charts.lat.set([series("ttft_p50", "TTFT p50", C[0], 1000), series("ttft_p90", "TTFT p90", C[0], 1000, { dash: true }),
                    series("tpot_p50", "TPOT p50", C[1], 1000)], range);
    const last = samples[samples.length - 1];
    if (last) {
      $("chart-tps").setAttribute("aria-label", "Tokens per second, now " + fmt.num(last.generation_tps, 1) + " generated");
      $("chart-req").setAttribute("aria-label", "Requests: " + last.running + " running, " + last.waiting + " waiting");
      $("chart-kv").setAttribute("aria-label", "KV-cache usage now " + fmt.pct(last.kv_cache_usage));
      $("chart-lat").setAttribute("aria-label", "TTFT p50 over the last minute " + fmt.ms(last.ttft_p50));
    }
  }

  async function poll() {
    if (paused || document.hidden || inFlight) return;
    inFlight = true;
    try {
      const snap = await MLC.json("/api/metrics" + (lastTime === null ? "" : "?since=" + lastTime));
      for (const r of snap.history) samples.push(r);
      while (samples.length > 600) samples.shift();
      if (snap.history.length) lastTime = snap.history[snap.history.length - 1].t;
      serverNow = snap.time;
      $("error").hidden = true;
      $("status-dot").className = "dot " + (snap.status === "healthy" ? "ok" : snap.status === "loading" ? "wait" : "bad");
      setText("status-text", snap.model + " " + (snap.status === "healthy" ? "ready" : snap.status));
      tiles(snap);
      drawCharts();
    } catch (e) {
      $("error").hidden = false;
      $("error").textContent = "Cannot read /api/metrics: " + e.message;
      $("status-dot").className = "dot bad";
    } finally {
      inFlight = false;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    // time axis: seconds before now, ticks on whole 10 s / 1 min / 2 min steps
    const xStep = (range, n) => [10, 15, 30, 60, 120, 300].find((st) => range / st <= n) || 600;
    const xFormat = (v) => (v > -0.5 ? "now" : -v >= 60 && -v % 60 === 0 ? -v / 60 + " min ago" : Math.round(-v) + " s ago");
    const opts = { xFormat, xStep, yMin: 0 };
    charts = {
      tps: new MLC.Chart($("chart-tps"), Object.assign({ legend: "legend-tps" }, opts)),
      req: new MLC.Chart($("chart-req"), Object.assign({ legend: "legend-req", integer: true }, opts)),
      kv: new MLC.Chart($("chart-kv"), Object.assign({ legend: "legend-kv", yMax: 100 }, opts)),
      lat: new MLC.Chart($("chart-lat"), Object.assign({ legend: "legend-lat" }, opts)),
    };
    $("window").addEventListener("change", drawCharts);
    $("pause").addEventListener("click", (e) => {
      paused = !paused;
      e.currentTarget.setAttribute("aria-pressed", String(paused));
      e.currentTarget.textContent = paused ? "Resume updates" : "Pause updates";
      if (!paused) poll();
    });
    document.addEventListener("mlc:key", poll);
    poll();
    setInterval(poll, 1000);
  });
})(window.MLC);
