// One streamed chat completion: POST /v1/chat/completions with stream: true, read the server-sent events, and hand
// each delta (content, reasoning_content, tool_calls) to the page as it arrives. Aborting `signal` closes the
// connection, and the server then aborts the request and frees its KV pages.
"use strict";
window.MLC = window.MLC || {};

(function (MLC) {
  function mergeToolCalls(calls, deltas) {
    for (const tc of deltas) {
      const k = Number.isInteger(tc.index) ? tc.index : calls.length;
      const cur = calls[k] || (calls[k] = { id: "", type: "function", function: { name: "", arguments: "" } });
      if (tc.id) cur.id = tc.id;
      if (tc.type) cur.type = tc.type;
      const f = tc.function || {};
      if (f.name) cur.function.name += f.name;
      if (f.arguments) cur.function.arguments += typeof f.arguments === "string" ? f.arguments : JSON.stringify(f.arguments);
    }
  }

  // handlers.update(state) is called after every event that changed the reply.
  // Resolves with the final state: {content, reasoning, toolCalls, finish, usage, chunks, firstAt, endAt}.
  MLC.streamChat = async function (body, signal, handlers) {
    const state = { content: "", reasoning: "", toolCalls: [], finish: null, usage: null, chunks: 0, model: null,
                    startAt: performance.now(), firstAt: null, endAt: null };
    const r = await MLC.api("/v1/chat/completions", {
      method: "POST", signal, headers: { "Content-Type": "application/json" },
      body: JSON.stringify(Object.assign({}, body, { stream: true, stream_options: { include_usage: true } })),
    });
    if (!r.ok) throw new MLC.HttpError(r.status, await MLC.errorMessage(r));
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    const apply = (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.model) state.model = chunk.model;
      if (chunk.usage) state.usage = chunk.usage;
      let changed = false;
      for (const c of chunk.choices || []) {
        const d = c.delta || c.message || {};
        const reasoning = d.reasoning_content || d.reasoning;
        if (typeof reasoning === "string" && reasoning) { state.reasoning += reasoning; changed = true; }
        if (typeof d.content === "string" && d.content) { state.content += d.content; changed = true; }
        if (Array.isArray(d.tool_calls) && d.tool_calls.length) { mergeToolCalls(state.toolCalls, d.tool_calls); changed = true; }
        if (c.finish_reason) state.finish = c.finish_reason;
      }
      if (changed) {
        state.chunks++;
        if (state.firstAt === null) state.firstAt = performance.now();
      }
      if (handlers && handlers.update) handlers.update(state);
    };
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
          if (!data || data === "[DONE]") continue;
          apply(JSON.parse(data));
        }
      }
    } finally {
      state.endAt = performance.now();
    }
    return state;
  };

  // "123 tokens · 45.6 tok/s · first token 120 ms · stop"
  MLC.replyStats = function (s, stopped, live) {
    const n = s.usage ? s.usage.completion_tokens : s.chunks;
    const parts = [(s.usage ? "" : "~") + n + (n === 1 ? " token" : " tokens")];
    if (s.firstAt !== null && s.endAt - s.firstAt > 50 && n > 1) { // a rate over < 50 ms says nothing
      parts.push(MLC.fmt.num((n - 1) / ((s.endAt - s.firstAt) / 1000), 1) + " tok/s");
    }
    if (s.firstAt !== null) parts.push("first token " + MLC.fmt.ms((s.firstAt - s.startAt) / 1000));
    if (s.model && !live) parts.push(s.model);
    if (!live) parts.push(stopped ? "stopped" : (s.finish || "ended"));
    return parts.join(" · ");
  };
})(window.MLC);
