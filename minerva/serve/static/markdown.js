// Markdown for the chat page, as models write it: fenced code (highlighted), inline code,
// headings, lists, quotes, bold, italics and links. Everything is escaped first, so the model's
// text can never become markup of its own; a code fence left open (the answer is still
// streaming) renders as code up to the end.
"use strict";

(function () {
  const KEYWORDS = new Set((
    "and as assert async await break case catch class const continue def default del do elif else enum " +
    "except export extends false False finally fn for from func function go if impl import in interface is " +
    "lambda let loop match mod mut new nil None not null or package pass pub raise return self static struct " +
    "super switch this throw true True try type typeof use var void while with yield int float double char " +
    "bool string str long unsigned void public private protected"
  ).split(" "));

  function escape(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // Strings, comments, numbers and keywords of most C-like and script languages, on raw code.
  const TOKEN = /("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`(?:[^`\\]|\\.)*`)|(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|(\b\d+(?:\.\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;

  function highlight(code) {
    let out = "", last = 0, m;
    TOKEN.lastIndex = 0;
    while ((m = TOKEN.exec(code)) !== null) {
      out += escape(code.slice(last, m.index));
      const [all, str, com, num, word] = m;
      if (str) out += `<span class="hl-str">${escape(str)}</span>`;
      else if (com) out += `<span class="hl-com">${escape(com)}</span>`;
      else if (num) out += `<span class="hl-num">${num}</span>`;
      else if (KEYWORDS.has(word)) out += `<span class="hl-kw">${word}</span>`;
      else out += escape(all);
      last = m.index + all.length;
    }
    return out + escape(code.slice(last));
  }

  function inline(text) {
    // `text` is escaped already; code spans are cut out first so nothing inside them is touched.
    const spans = [];
    text = text.replace(/`([^`\n]+)`/g, (_, code) => { spans.push(code); return `\u0000${spans.length - 1}\u0000`; });
    text = text
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return text.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${spans[+i]}</code>`);
  }

  function blocks(text) {
    const lines = text.split("\n"), out = [];
    let para = [], list = null;
    const flush = () => {
      if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
      para = [];
      if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    for (const raw of lines) {
      const line = escape(raw);
      let m;
      if (!raw.trim()) { flush(); continue; }
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) { flush(); out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`); continue; }
      if ((m = /^&gt;\s?(.*)$/.exec(line))) { flush(); out.push(`<blockquote>${inline(m[1])}</blockquote>`); continue; }
      if ((m = /^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/.exec(line))) {
        const tag = m[1] ? "ol" : "ul";
        if (para.length || (list && list.tag !== tag)) flush();
        list = list || { tag, items: [] };
        list.items.push(m[2]);
        continue;
      }
      if (list) flush();
      para.push(line);
    }
    flush();
    return out.join("");
  }

  function renderMarkdown(text) {
    const parts = text.split(/^```/m);
    let html = "";
    parts.forEach((part, i) => {
      if (i % 2 === 0) { html += blocks(part); return; }
      const newline = part.indexOf("\n");
      const lang = newline < 0 ? part.trim() : part.slice(0, newline).trim();
      const code = newline < 0 ? "" : part.slice(newline + 1).replace(/\n$/, "");
      html += `<pre><code data-lang="${escape(lang)}">${highlight(code)}</code></pre>`;
    });
    return html;
  }

  window.renderMarkdown = renderMarkdown;
  window.escapeHtml = escape;
})();
