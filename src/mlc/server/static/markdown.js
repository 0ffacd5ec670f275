// A small, safe Markdown renderer for model output: every piece of text is HTML-escaped before any markup is added,
// links keep only http(s), mailto and same-site targets, and no raw HTML passes through. Handles what chat models
// write: fenced code (an unclosed fence while streaming), inline code, headings, bold/italic/strike, links,
// bullet and numbered lists (nested), block quotes, tables and rules.
"use strict";
window.MLC = window.MLC || {};

(function (MLC) {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function safeUrl(url) {
    // anything but these schemes (javascript:, data:, ...) stays plain text
    return /^(https?:\/\/|mailto:|\/(?!\/)|#)/i.test(url) ? url : null;
  }

  function inline(src) {
    const held = [];
    const hold = (html) => { held.push(html); return "\u0001" + (held.length - 1) + "\u0002"; };
    const link = (url, text) => hold('<a href="' + esc(url) + '" target="_blank" rel="noopener noreferrer">' +
      esc(text) + "</a>");
    let s = src.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => hold("<code>" + esc(code.trim()) + "</code>"));
    s = s.replace(/\[([^\]\n]+)\]\(([^()\s"<>]+)(?:\s+"[^"\n]*")?\)/g, (m, text, url) =>
      (safeUrl(url) ? link(url, text) : m));
    s = s.replace(/(^|[\s(])(https?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]])/g, (m, pre, url) => pre + link(url, url));
    s = esc(s);
    s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
         .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
         .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>")
         .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
         .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
    return s.replace(/\u0001(\d+)\u0002/g, (_, i) => held[Number(i)]);
  }

  function codeBlock(lang, body) {
    const label = lang ? esc(lang) : "code";
    return '<div class="code-block"><div class="code-head"><span>' + label + "</span>" +
      '<button type="button" class="copy" aria-label="Copy code">Copy</button></div>' +
      "<pre><code" + (lang ? ' class="lang-' + esc(lang) + '"' : "") + ">" + esc(body) + "</code></pre></div>";
  }

  const indentOf = (line) => line.match(/^\s*/)[0].replace(/\t/g, "    ").length;
  const isBlank = (line) => /^\s*$/.test(line);
  const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line);

  function dedent(lines) {
    const ind = Math.min(...lines.filter((l) => !isBlank(l)).map(indentOf), 99);
    return lines.map((l) => l.replace(/\t/g, "    ").slice(Math.min(ind, indentOf(l))));
  }

  function list(lines, i) {
    const first = lines[i].match(ITEM);
    const ordered = /\d/.test(first[2]), base = indentOf(lines[i]);
    const items = [];
    while (i < lines.length) {
      const line = lines[i], m = line.match(ITEM);
      if (m && indentOf(line) === base && /\d/.test(m[2]) === ordered) { items.push([m[3]]); i++; continue; }
      if (isBlank(line)) {
        const next = lines[i + 1];
        const nm = next !== undefined && next.match(ITEM);
        const sameKind = nm && indentOf(next) === base && /\d/.test(nm[2]) === ordered;
        if (next !== undefined && !isBlank(next) && (indentOf(next) > base || sameKind)) {
          items[items.length - 1].push(""); i++; continue;
        }
        break;
      }
      if (indentOf(line) > base) { items[items.length - 1].push(line); i++; continue; }
      if (!startsBlock(line) && !isBlank(lines[i - 1])) { items[items.length - 1].push(line.trim()); i++; continue; }
      break;
    }
    const start = ordered ? parseInt(first[2], 10) : 1;
    const open = ordered ? (start !== 1 ? '<ol start="' + start + '">' : "<ol>") : "<ul>";
    const body = items.map((it) => {
      const rest = dedent(it.slice(1));
      const loose = it.some(isBlank);
      let html = blocks([it[0], ...rest]);
      if (!loose) html = html.replace(/^<p>([\s\S]*?)<\/p>/, "$1");
      return "<li>" + html + "</li>";
    }).join("");
    return [open + body + (ordered ? "</ol>" : "</ul>"), i];
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(lines, i) {
    const head = cells(lines[i]);
    const aligns = cells(lines[i + 1]).map((c) => (c.startsWith(":") && c.endsWith(":") ? "center" :
      c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : ""));
    const cls = (k) => (aligns[k] ? ' class="al-' + aligns[k] + '"' : "");
    let html = '<div class="table-scroll"><table><thead><tr>' +
      head.map((c, k) => "<th" + cls(k) + ">" + inline(c) + "</th>").join("") + "</tr></thead><tbody>";
    i += 2;
    while (i < lines.length && lines[i].includes("|") && !isBlank(lines[i])) {
      const row = cells(lines[i]);
      html += "<tr>" + head.map((_, k) => "<td" + cls(k) + ">" + inline(row[k] || "") + "</td>").join("") + "</tr>";
      i++;
    }
    return [html + "</tbody></table></div>", i];
  }

  function blocks(lines) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (isBlank(line)) { i++; continue; }
      if ((m = line.match(FENCE))) {
        const mark = m[1], body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(mark) && /^[`~]+$/.test(lines[i].trim()))) body.push(lines[i++]);
        i++; // the closing fence (absent while a reply still streams)
        out.push(codeBlock(m[2], body.join("\n")));
      } else if ((m = line.match(HEADING))) {
        const n = m[1].length;
        out.push("<h" + n + ">" + inline(m[2]) + "</h" + n + ">"); i++;
      } else if (RULE.test(line)) {
        out.push("<hr>"); i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && !isBlank(lines[i]) && (QUOTE.test(lines[i]) || body.length)) {
          body.push(lines[i].replace(QUOTE, "")); i++;
        }
        out.push("<blockquote>" + blocks(body) + "</blockquote>");
      } else if (ITEM.test(line)) {
        const [html, next] = list(lines, i);
        out.push(html); i = next;
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("|")) {
        const [html, next] = table(lines, i);
        out.push(html); i = next;
      } else {
        const para = [];
        while (i < lines.length && !isBlank(lines[i]) && (para.length === 0 || !startsBlock(lines[i]))) para.push(lines[i++].trim());
        out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      }
    }
    return out.join("");
  }

  MLC.escapeHtml = esc;
  MLC.markdown = function (text) {
    const clean = String(text || "").replace(/[\u0000-\u0002]/g, "").replace(/\r\n?/g, "\n");
    return blocks(clean.split("\n"));
  };

  // One listener for every code block's copy button.
  document.addEventListener("click", (e) => {
    const btn = e.target.closest && e.target.closest("button.copy");
    if (!btn) return;
    const code = btn.closest(".code-block").querySelector("code").textContent;
    const done = () => { btn.textContent = "Copied"; setTimeout(() => (btn.textContent = "Copy"), 1200); };
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(code).then(done, () => {});
    else {
      const range = document.createRange();
      range.selectNodeContents(btn.closest(".code-block").querySelector("code"));
      const sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(range);
      btn.textContent = "Selected: press Ctrl+C";
    }
  });
})(window.MLC);
