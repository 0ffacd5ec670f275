// The chat playground: conversations (chat_store.js), the model/adapter choice from /v1/models, sampling settings,
// streamed replies rendered as Markdown (markdown.js), reasoning and tool calls in their own blocks, and a Stop button.
"use strict";

(function (MLC) {
  const $ = MLC.$, store = MLC.chatStore;
  let chat = null, controller = null, models = [];

  // -- settings -------------------------------------------------------------------------------------------------
  const FIELDS = ["temperature", "top_p", "max_tokens"];
  function loadSettings() {
    const s = store.settings();
    for (const f of FIELDS) if (s[f] !== undefined && s[f] !== null) $(f).value = s[f];
    return s;
  }
  function saveSettings() {
    const s = { model: $("model").value };
    for (const f of FIELDS) s[f] = $(f).value;
    store.saveSettings(s);
  }
  function numberField(id, name) {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const v = Number(raw), el = $(id);
    if (!isFinite(v) || (el.min && v < Number(el.min)) || (el.max && v > Number(el.max))) {
      throw new Error(name + " must be a number" + (el.min ? " from " + el.min : "") + (el.max ? " to " + el.max : ""));
    }
    return v;
  }

  let shownModels = null;
  async function loadModels() {
    try {
      const body = await MLC.json("/v1/models");
      models = body.data || [];
    } catch (e) {
      $("model-info").textContent = "Could not list models: " + e.message;
      return;
    }
    const ids = models.map((m) => m.id).join("\n");
    if (ids === shownModels) return;  // unchanged: keep the open list as it is
    shownModels = ids;
    const sel = $("model"), want = store.settings().model;
    sel.textContent = "";
    models.forEach((m, k) => {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.id + (m.parent ? " (adapter of " + m.parent + ")" : k === 0 ? " (base)" : " (adapter)");
      sel.appendChild(o);
    });
    if (models.some((m) => m.id === want)) sel.value = want;
    showModelInfo();
  }
  function showModelInfo() {
    const m = models.find((x) => x.id === $("model").value);
    $("model-info").textContent = m ? "Context " + m.max_model_len + " tokens" + (m.weights ? "; " + m.weights : "") : "";
    if (m) $("max_tokens").max = m.max_model_len;
    MLC.readyText = m ? m.id + " ready" : "ready";
    if ($("status-dot").classList.contains("ok")) $("status-text").textContent = MLC.readyText;
  }

  // -- conversations ----------------------------------------------------------------------------------------------
  function renderList() {
    const ul = $("conv-list");
    ul.textContent = "";
    for (const c of store.chats) {
      const li = document.createElement("li");
      if (chat && c.id === chat.id) li.setAttribute("aria-current", "true");
      const open = document.createElement("button");
      open.type = "button"; open.className = "open"; open.textContent = c.title || "New chat";
      open.title = c.title;
      open.addEventListener("click", () => { openChat(c.id); closeDrawers(); $("prompt").focus(); });
      const del = document.createElement("button");
      del.type = "button"; del.className = "icon delete"; del.textContent = "✕";
      del.setAttribute("aria-label", "Delete conversation: " + (c.title || "New chat"));
      del.addEventListener("click", () => deleteChat(c.id));
      li.append(open, del);
      ul.appendChild(li);
    }
  }
  function openChat(id) {
    if (controller) controller.abort();
    chat = store.get(id) || store.create();
    store.setCurrent(chat.id);
    $("system").value = chat.system || "";
    const box = $("messages");
    box.textContent = "";
    if (!chat.messages.length) box.appendChild(emptyNote());
    for (const m of chat.messages) box.appendChild(m.role === "user" ? userBubble(m.content) : assistantBubble(m).el);
    box.scrollTop = box.scrollHeight;
    renderList();
  }
  function deleteChat(id) {
    store.remove(id);
    if (chat && chat.id === id) openChat(store.chats.length ? store.chats[0].id : store.create().id);
    else renderList();
  }
  function emptyNote() {
    const d = document.createElement("div");
    d.className = "empty"; d.id = "empty";
    d.textContent = "Ask something. Replies stream from the server; pick the base model or a LoRA adapter under Settings.";
    return d;
  }

  // -- messages ---------------------------------------------------------------------------------------------------
  function userBubble(text) {
    const el = document.createElement("article");
    el.className = "msg user"; el.setAttribute("aria-label", "You");
    el.textContent = text;
    return el;
  }
  function block(kind, title) {
    const d = document.createElement("details");
    d.className = kind;
    const s = document.createElement("summary"); s.textContent = title;
    const body = document.createElement("div"); body.className = "block-body";
    d.append(s, body);
    return { d, s, body };
  }
  function assistantBubble(m) {
    const el = document.createElement("article");
    el.className = "msg assistant"; el.setAttribute("aria-label", "Assistant");
    const role = document.createElement("div"); role.className = "role"; role.textContent = "Assistant";
    const reasoning = block("reasoning", "Reasoning");
    const content = document.createElement("div"); content.className = "content md";
    const tools = document.createElement("div"); tools.className = "tool-calls";
    const meta = document.createElement("div"); meta.className = "meta";
    el.append(role, reasoning.d, content, tools, meta);
    const view = {
      el,
      render(msg, live) {
        reasoning.d.hidden = !msg.reasoning;
        reasoning.body.textContent = msg.reasoning || "";
        if (live && msg.reasoning && !msg.content) reasoning.d.open = true;
        content.innerHTML = MLC.markdown(msg.content || "");
        content.classList.toggle("cursor", !!live);
        tools.textContent = "";
        for (const tc of msg.tool_calls || []) tools.appendChild(toolBlock(tc));
        meta.textContent = msg.meta || "";
        meta.classList.toggle("stopped", !!msg.stopped);
        const err = el.querySelector(".error-box");
        if (err) err.remove();
        if (msg.error) {
          const e = document.createElement("div"); e.className = "error-box"; e.setAttribute("role", "alert");
          e.textContent = msg.error; el.insertBefore(e, meta);
        }
      },
    };
    view.render(m, false);
    return view;
  }
  function toolBlock(tc) {
    const f = tc.function || {};
    const b = block("tool", "Tool call: " + (f.name || "(unnamed)"));
    b.d.open = true;
    let args = f.arguments || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* still streaming, or not JSON */ }
    const pre = document.createElement("pre"), code = document.createElement("code");
    code.textContent = args;
    pre.appendChild(code);
    if (tc.id) { const id = document.createElement("div"); id.className = "muted small"; id.textContent = "id " + tc.id; b.body.appendChild(id); }
    b.body.appendChild(pre);
    return b.d;
  }

  // -- sending ----------------------------------------------------------------------------------------------------
  function apiMessages() {
    const out = [];
    const system = $("system").value.trim();
    if (system) out.push({ role: "system", content: system });
    for (const m of chat.messages) {
      if (m.role === "user") out.push({ role: "user", content: m.content });
      else if (m.content || (m.tool_calls && m.tool_calls.length)) {
        const a = { role: "assistant", content: m.content || "" };
        if (m.tool_calls && m.tool_calls.length) a.tool_calls = m.tool_calls;
        out.push(a);
      }
    }
    return out;
  }
  function nearBottom(box) { return box.scrollHeight - box.scrollTop - box.clientHeight < 80; }
  function busy(on) {
    $("send").disabled = on; $("stop").disabled = !on;
    $("messages").setAttribute("aria-busy", on ? "true" : "false");
  }

  async function send(text) {
    let body;
    try {
      body = { messages: null, temperature: numberField("temperature", "Temperature"),
               top_p: numberField("top_p", "Top-p"), max_tokens: numberField("max_tokens", "Max tokens") };
    } catch (e) { alertBox(e.message); return; }
    if ($("model").value) body.model = $("model").value;
    const conv = chat; // the user may open another conversation while this reply streams
    chat.system = $("system").value;
    chat.messages.push({ role: "user", content: text });
    body.messages = apiMessages();
    const box = $("messages");
    const empty = $("empty"); if (empty) empty.remove();
    box.appendChild(userBubble(text));
    const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], meta: "waiting for the first token…" };
    chat.messages.push(msg);
    store.touch(chat); renderList();
    const view = assistantBubble(msg);
    box.appendChild(view.el);
    box.scrollTop = box.scrollHeight;
    controller = new AbortController();
    const mine = controller;
    busy(true);
    let frame = null, last = null, stopped = false;
    const paint = () => {
      frame = null;
      const stick = nearBottom(box);
      Object.assign(msg, { content: last.content, reasoning: last.reasoning, tool_calls: last.toolCalls });
      if (last.firstAt !== null) { last.endAt = performance.now(); msg.meta = "streaming · " + MLC.replyStats(last, false, true); }
      view.render(msg, true);
      if (stick) box.scrollTop = box.scrollHeight;
    };
    try {
      last = await MLC.streamChat(body, controller.signal, {
        update(s) { last = s; if (frame === null) frame = requestAnimationFrame(paint); },
      });
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else msg.error = e.message;
    }
    if (frame !== null) cancelAnimationFrame(frame);
    if (last) {
      last.endAt = performance.now();
      Object.assign(msg, { content: last.content, reasoning: last.reasoning, tool_calls: last.toolCalls,
                           meta: MLC.replyStats(last, stopped), stopped });
    } else msg.meta = stopped ? "stopped before the first token" : "";
    if (stopped && !last) msg.stopped = true;
    view.render(msg, false);
    if (nearBottom(box)) box.scrollTop = box.scrollHeight;
    store.touch(conv);
    if (conv === chat) renderList();
    if (store.error) alertBox(store.error);
    if (controller === mine) { controller = null; busy(false); }
  }
  function alertBox(text) {
    const d = document.createElement("div");
    d.className = "msg assistant"; d.setAttribute("role", "alert");
    const e = document.createElement("div"); e.className = "error-box"; e.textContent = text;
    d.appendChild(e);
    $("messages").appendChild(d);
  }

  // -- wiring -----------------------------------------------------------------------------------------------------
  function closeDrawers() {
    for (const id of ["conversations", "settings"]) {
      $(id).classList.remove("open");
      $("toggle-" + (id === "conversations" ? "chats" : "settings")).setAttribute("aria-expanded", "false");
    }
  }
  function toggleDrawer(id, button) {
    const open = !$(id).classList.contains("open");
    closeDrawers();
    $(id).classList.toggle("open", open);
    button.setAttribute("aria-expanded", String(open));
    if (open) $(id).querySelector("button, select, textarea, input").focus();
  }

  document.addEventListener("DOMContentLoaded", () => {
    loadSettings();
    openChat(store.current() || (store.chats[0] && store.chats[0].id));
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => { if (controller) controller.abort(); $("prompt").focus(); });
    document.addEventListener("keydown", (e) => {
      if (e.key !== "Escape") return;
      if (controller) controller.abort(); else closeDrawers();
    });
    $("new-chat").addEventListener("click", () => {
      if (controller || chat.messages.length) openChat(store.create().id); // an empty conversation is reused
      closeDrawers();
      $("prompt").focus();
    });
    $("clear-chat").addEventListener("click", () => { chat.messages = []; store.touch(chat); openChat(chat.id); });
    $("system").addEventListener("change", () => { chat.system = $("system").value; store.touch(chat); });
    $("model").addEventListener("change", () => { saveSettings(); showModelInfo(); });
    for (const f of FIELDS) $(f).addEventListener("change", saveSettings);
    $("toggle-chats").addEventListener("click", (e) => toggleDrawer("conversations", e.currentTarget));
    $("toggle-settings").addEventListener("click", (e) => toggleDrawer("settings", e.currentTarget));
    document.querySelectorAll(".drawer-close").forEach((b) => b.addEventListener("click", closeDrawers));
    document.addEventListener("mlc:key", loadModels);
    $("model").addEventListener("focus", loadModels);  // adapters loaded at run time show up
    MLC.watchHealth(loadModels);
  });
})(window.MLC);
