// Conversations and chat settings in the browser's localStorage (never on the server).
// A conversation: {id, title, created, updated, system, messages: [{role, content, reasoning, tool_calls, meta}]}.
"use strict";
window.MLC = window.MLC || {};

(function (MLC) {
  const CHATS = "mlc.chats.v1", SETTINGS = "mlc.chat.settings.v1";

  function load() {
    try {
      const v = JSON.parse(localStorage.getItem(CHATS) || "[]");
      return Array.isArray(v) ? v.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
    } catch (e) { return []; }
  }

  const store = {
    chats: load(),
    error: null,
    save() {
      try { localStorage.setItem(CHATS, JSON.stringify(this.chats)); this.error = null; }
      catch (e) { this.error = "This browser's storage is full: delete old conversations to keep new ones."; }
    },
    create() {
      const now = Date.now();
      const chat = { id: now.toString(36) + Math.random().toString(36).slice(2, 7), title: "New chat", created: now,
                     updated: now, system: "", messages: [] };
      this.chats.unshift(chat);
      this.save();
      return chat;
    },
    get(id) { return this.chats.find((c) => c.id === id) || null; },
    touch(chat) {
      chat.updated = Date.now();
      const first = chat.messages.find((m) => m.role === "user");
      if (first && chat.title === "New chat") chat.title = first.content.replace(/\s+/g, " ").trim().slice(0, 60);
      this.chats.sort((a, b) => b.updated - a.updated);
      this.save();
    },
    remove(id) { this.chats = this.chats.filter((c) => c.id !== id); this.save(); },
    settings() {
      try { return Object.assign({}, JSON.parse(localStorage.getItem(SETTINGS) || "{}")); } catch (e) { return {}; }
    },
    saveSettings(s) { try { localStorage.setItem(SETTINGS, JSON.stringify(s)); } catch (e) { /* full: keep going */ } },
    current() { return localStorage.getItem(CHATS + ".current"); },
    setCurrent(id) { try { localStorage.setItem(CHATS + ".current", id); } catch (e) { /* full */ } },
  };

  MLC.chatStore = store;
})(window.MLC);
