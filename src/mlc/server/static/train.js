// The training view: GET /api/train/run?dir=... for one run (and optionally a second to compare), polled every two
// seconds while a run is live. Loss is drawn raw and smoothed (the same bias-corrected EMA as `train plot`), with
// eval points and the skipped steps marked.
"use strict";

(function (MLC) {
  const $ = MLC.$, fmt = MLC.fmt, C = MLC.COLORS;
  const runs = { a: null, b: null };
  let charts = null, timer = null, token = 0;

  function setText(id, text) { const el = $(id); if (el.textContent !== text) el.textContent = text; }

  function autoWeight(n) { return Math.min(0.9, 1.8 * (1 / (1 + Math.exp(-0.05 * n)) - 0.5)); }
  function smooth(points, weight) {
    let avg = 0, i = 0;
    return points.map(([x, y]) => {
      i++;
      avg = weight * avg + (1 - weight) * y;
      return [x, avg / (1 - Math.pow(weight, i))];
    });
  }
  function weightFor(n) {
    const v = Number($("smoothing").value);
    return v > 0 ? v : autoWeight(n);
  }

  function statusText(run) {
    if (run.status === "running") return "running";
    if (run.status === "finished") return "finished";
    return "stopped";
  }

  function tiles(run) {
    const last = run.last;
    setText("run-title", run.name + (runs.b ? " compared with " + runs.b.name : ""));
    const c = run.config;
    setText("run-sub", [run.dir, c.model && "model " + c.model, c.lr && "lr " + fmt.sci(c.lr),
      c.batch_size && "batch " + c.batch_size + (c.gradient_accumulation_steps > 1 ? " × " + c.gradient_accumulation_steps : "")]
      .filter(Boolean).join(" · "));
    setText("tile-status", statusText(run));
    setText("tile-status-sub", run.updated_at ? "log updated " + fmt.clock(run.updated_at) : "");
    setText("tile-step", run.total_steps ? run.step + " / " + run.total_steps : String(run.step));
    $("bar-step").style.width = run.total_steps ? Math.min(100, (100 * run.step) / run.total_steps).toFixed(1) + "%" : "0";
    setText("tile-step-sub", run.seconds_per_step ? fmt.num(run.seconds_per_step, 2) + " s per step" +
      (run.status === "running" ? "" : " (when it ran)") : "");
    setText("tile-loss", fmt.num(last.loss, 4));
    setText("tile-loss-sub", last.eval_loss !== null ? "eval " + fmt.num(last.eval_loss, 4) : "no eval yet");
    setText("tile-lr", fmt.sci(last.lr));
    setText("tile-gn", fmt.num(last.grad_norm, 3));
    setText("tile-gn-sub", run.config.clip_norm ? "clipped at " + run.config.clip_norm : "");
    setText("tile-tps", fmt.num(last.tokens_per_s, 0));
    setText("tile-skipped", String(run.skipped_total));
    setText("tile-eta", run.status === "finished" ? "done" : run.eta_s !== null ? fmt.dur(run.eta_s) : "–");
    setText("tile-eta-sub", run.status === "running" ? "from the last logged steps" : run.status === "finished" ? "" : "not running");
    $("status-dot").className = "dot " + (run.status === "running" ? "ok" : run.status === "finished" ? "ok" : "wait");
    setText("status-text", run.name + ": " + statusText(run));
  }

  function compareTable() {
    const a = runs.a, b = runs.b, table = $("compare-table");
    $("compare-wrap").hidden = !(a && b);
    if (!(a && b)) return;
    const bestEval = (r) => { const v = r.evals.map((e) => e.eval_loss).filter((x) => x !== null); return v.length ? Math.min(...v) : null; };
    const rows = [
      ["Status", statusText(a), statusText(b)],
      ["Step", a.step + (a.total_steps ? " / " + a.total_steps : ""), b.step + (b.total_steps ? " / " + b.total_steps : "")],
      ["Last loss", fmt.num(a.last.loss, 4), fmt.num(b.last.loss, 4)],
      ["Best eval loss", fmt.num(bestEval(a), 4), fmt.num(bestEval(b), 4)],
      ["Learning rate (config)", fmt.sci(a.config.lr), fmt.sci(b.config.lr)],
      ["Tokens / s", fmt.num(a.last.tokens_per_s, 0), fmt.num(b.last.tokens_per_s, 0)],
      ["Skipped steps", String(a.skipped_total), String(b.skipped_total)],
      ["Checkpoints", String(a.checkpoints.length), String(b.checkpoints.length)],
    ];
    table.querySelectorAll("thead, tbody").forEach((el) => el.remove());
    const head = table.createTHead().insertRow();
    for (const h of ["", a.name + " (A)", b.name + " (B)"]) { const th = document.createElement("th"); th.scope = "col"; th.textContent = h; head.appendChild(th); }
    const body = table.createTBody();
    for (const r of rows) {
      const tr = body.insertRow();
      const th = document.createElement("th"); th.scope = "row"; th.textContent = r[0]; tr.appendChild(th);
      for (const v of r.slice(1)) tr.insertCell().textContent = v;
    }
  }

  function checkpoints() {
    const body = $("checkpoints").tBodies[0];
    body.textContent = "";
    const list = [];
    for (const [tag, run] of [["A", runs.a], ["B", runs.b]]) if (run) for (const c of run.checkpoints) list.push([runs.b ? run.name + " (" + tag + ")" : run.name, c]);
    if (!list.length) { const td = body.insertRow().insertCell(); td.colSpan = 4; td.className = "muted"; td.textContent = "none yet"; return; }
    for (const [name, c] of list) {
      const tr = body.insertRow();
      tr.insertCell().textContent = name;
      tr.insertCell().textContent = String(c.step);
      tr.insertCell().textContent = new Date(c.saved_at * 1000).toLocaleString();
      const p = tr.insertCell(); p.className = "path"; p.textContent = c.path;
    }
  }

  function runSeries(run, k, key, label) {
    const color = C[k === 0 ? 0 : 1], dash = k === 1;
    return { label: run.name + (runs.b ? (k === 0 ? " (A)" : " (B)") : "") + (label ? " " + label : ""), color, dash,
             points: run.steps.map((s) => [s.step, s[key]]) };
  }

  function drawCharts() {
    const loss = [], lr = [], gn = [], tps = [];
    [runs.a, runs.b].forEach((run, k) => {
      if (!run) return;
      const good = run.steps.filter((s) => !s.skipped && s.loss !== null).map((s) => [s.step, s.loss]);
      const w = weightFor(good.length), base = runSeries(run, k, "loss", "");
      loss.push({ label: base.label + " loss", color: base.color, alpha: 0.3, width: 1, points: good, noLegend: false });
      loss.push({ label: base.label + " smoothed (EMA " + w.toFixed(2) + ")", color: base.color, width: 2.2, dash: base.dash, points: smooth(good, w) });
      const evals = run.evals.filter((e) => e.eval_loss !== null).map((e) => [e.step, e.eval_loss]);
      if (evals.length) loss.push({ label: base.label + " eval loss", color: C[k === 0 ? 2 : 3], width: 1.5, dots: true, points: evals, dash: base.dash });
      const skipped = run.steps.filter((s) => s.skipped).map((s) => s.step);
      if (skipped.length) loss.push({ label: base.label + " skipped steps", color: C[4], points: [], marks: skipped });
      lr.push(runSeries(run, k, "lr", ""));
      gn.push(runSeries(run, k, "grad_norm", ""));
      tps.push(runSeries(run, k, "tokens_per_s", ""));
    });
    charts.loss.set(loss); charts.lr.set(lr); charts.gn.set(gn); charts.tps.set(tps);
    const a = runs.a;
    if (a) {
      $("chart-loss").setAttribute("aria-label", "Loss curve of " + a.name + ": " + a.steps.length + " logged steps, last loss " +
        fmt.num(a.last.loss, 4) + (runs.b ? "; compared with " + runs.b.name + ", last loss " + fmt.num(runs.b.last.loss, 4) : ""));
      $("chart-lr").setAttribute("aria-label", "Learning rate, last " + fmt.sci(a.last.lr));
      $("chart-gn").setAttribute("aria-label", "Grad norm, last " + fmt.num(a.last.grad_norm, 3));
      $("chart-tps").setAttribute("aria-label", "Tokens per second, last " + fmt.num(a.last.tokens_per_s, 0));
    }
  }

  async function fetchRun(dir) {
    return MLC.json("/api/train/run?dir=" + encodeURIComponent(dir));
  }

  async function refresh() {
    const mine = ++token;
    clearTimeout(timer);
    const a = $("run-dir").value.trim(), b = $("compare-dir").value.trim();
    if (!a) return;
    const errors = [];
    const [ra, rb] = await Promise.all([fetchRun(a).catch((e) => { errors.push(e.message); return null; }),
      b ? fetchRun(b).catch((e) => { errors.push("compare: " + e.message); return null; }) : Promise.resolve(null)]);
    if (mine !== token) return;
    runs.a = ra; runs.b = rb;
    $("error").hidden = !errors.length;
    $("error").textContent = errors.join("; ") + (ra ? "" : " (waiting for the run to write its first files…)");
    $("run-view").hidden = !ra;
    $("hint").hidden = !!ra;
    if (ra) { tiles(ra); } else { setText("status-text", "waiting for " + a); $("status-dot").className = "dot wait"; }
    compareTable();
    checkpoints();
    drawCharts();
    const live = !ra || ra.status === "running" || (rb && rb.status === "running");
    const stopped = ra && ra.status === "stopped";
    if (live || stopped) timer = setTimeout(refresh, live ? 2000 : 10000);
  }

  // Under `mlc-cli train --ui` there is no chat or dashboard, and the run being trained is the default.
  async function standalone() {
    try {
      const r = await fetch("/api/train/ui");
      if (!r.ok) return;
      const info = await r.json();
      document.querySelectorAll("#nav a:not([href='/train'])").forEach((a) => a.parentElement.remove());
      if (!$("run-dir").value) $("run-dir").value = info.run;
    } catch (e) { /* the full server: keep the navigation */ }
  }

  function openFromForm() {
    const params = new URLSearchParams();
    params.set("run", $("run-dir").value.trim());
    if ($("compare-dir").value.trim()) params.set("compare", $("compare-dir").value.trim());
    history.replaceState(null, "", "/train?" + params.toString());
    refresh();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const opts = { xFormat: (v) => MLC.shortNum(v) };
    charts = {
      loss: new MLC.Chart($("chart-loss"), Object.assign({ legend: "legend-loss" }, opts)),
      lr: new MLC.Chart($("chart-lr"), Object.assign({ legend: "legend-lr", yMin: 0, yFormat: (v) => (v === 0 ? "0" : v.toExponential(1)) }, opts)),
      gn: new MLC.Chart($("chart-gn"), Object.assign({ legend: "legend-gn", yMin: 0 }, opts)),
      tps: new MLC.Chart($("chart-tps"), Object.assign({ legend: "legend-tps", yMin: 0 }, opts)),
    };
    const params = new URLSearchParams(location.search);
    $("run-dir").value = params.get("run") || "";
    $("compare-dir").value = params.get("compare") || "";
    $("run-form").addEventListener("submit", (e) => { e.preventDefault(); openFromForm(); });
    $("smoothing").addEventListener("input", () => {
      const v = Number($("smoothing").value);
      setText("smoothing-value", v > 0 ? v.toFixed(2) : "auto");
      drawCharts();
    });
    document.addEventListener("mlc:key", refresh);
    standalone().then(() => { if ($("run-dir").value) refresh(); else $("run-dir").focus(); });
  });
})(window.MLC);
