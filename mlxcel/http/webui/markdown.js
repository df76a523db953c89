// Markdown for model answers: a small subset (fences, headings, lists, quotes, tables, emphasis,
// inline code, links), rendered to an HTML string. Model output is untrusted: every piece of
// text is escaped before any tag is added, and links keep only http(s) targets.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (text) => String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);

// One pass of alternatives, tried at each position: comments, strings, numbers, keywords.
// Languages differ, but these shapes cover the common ones well enough to read code.
const KEYWORDS = new Set((
  "as async await break case catch class const continue def default del do elif else enum " +
  "except export extends false final finally fn for from func function go if impl import in " +
  "interface is let match mod mut new nil none None not null or and package pass pub raise " +
  "return self static struct super switch this throw true True False try type typeof use var " +
  "void while with yield lambda loop where int float str bool char string echo fi then done"
).split(" "));
const TOKEN = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d+(?:\.\d+)?\b)|([A-Za-z_]\w*)/g;

function highlight(code, lang) {
  // "#" starts a comment only where it does (python, shell, ruby, yaml...); in C it does not.
  const hashComments = /^(py|python|sh|bash|shell|zsh|rb|ruby|ya?ml|toml|r|perl|conf)$/i.test(lang);
  const re = new RegExp(TOKEN.source, "g");
  let out = "";
  let last = 0;
  let m;
  while ((m = re.exec(code))) {
    const [text, comment, str, num, word] = m;
    if (comment && text.startsWith("#") && !hashComments) {
      // Not a comment here: step over the "#" only, so what follows still gets its colours.
      re.lastIndex = m.index + 1;
      continue;
    }
    const cls = comment ? "hl-c" : str ? "hl-s" : num ? "hl-n" : KEYWORDS.has(word) ? "hl-k" : null;
    out += escapeHtml(code.slice(last, m.index));
    out += cls ? `<span class="${cls}">${escapeHtml(text)}</span>` : escapeHtml(text);
    last = m.index + text.length;
  }
  return out + escapeHtml(code.slice(last));
}

function inline(text) {
  // Code spans first: nothing inside them is markup.
  return text.split(/(`+[^`]*?`+)/).map((part, i) => {
    if (i % 2 === 1) return `<code>${escapeHtml(part.replace(/^`+|`+$/g, ""))}</code>`;
    let s = escapeHtml(part);
    s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
    s = s.replace(/\*\*([^*]+)\*\*|__([^_]+)__/g, (_, a, b) => `<strong>${a || b}</strong>`);
    s = s.replace(/(^|[^*\w])\*([^*\s][^*]*?)\*(?!\*)/g, "$1<em>$2</em>");
    s = s.replace(/~~([^~]+)~~/g, "<del>$1</del>");
    return s;
  }).join("");
}

const isTableRow = (line) => /^\s*\|.*\|\s*$/.test(line);
const cells = (line) => line.trim().replace(/^\||\|$/g, "").split("|").map((c) => inline(c.trim()));

function renderMarkdown(source) {
  const lines = source.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+#.-]*)/);
    if (fence) {
      const body = [];
      i++;
      // An answer still streaming may not have closed its fence yet: the rest is code.
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++;
      const lang = fence[2] || "";
      out.push(`<pre><code data-lang="${escapeHtml(lang)}">${highlight(body.join("\n"), lang)}</code></pre>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const n = heading[1].length;
      out.push(`<h${n}>${inline(heading[2])}</h${n}>`);
      i++;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      out.push("<hr>");
      i++;
      continue;
    }
    if (isTableRow(line) && i + 1 < lines.length && /^\s*\|[\s:|-]+\|\s*$/.test(lines[i + 1])) {
      const head = cells(line).map((c) => `<th>${c}</th>`).join("");
      const rows = [];
      i += 2;
      while (i < lines.length && isTableRow(lines[i])) {
        rows.push(`<tr>${cells(lines[i++]).map((c) => `<td>${c}</td>`).join("")}</tr>`);
      }
      out.push(`<table><thead><tr>${head}</tr></thead><tbody>${rows.join("")}</tbody></table>`);
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*> ?/, ""));
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
      continue;
    }
    const item = /^\s*([-*+]|\d+[.)])\s+/;
    if (item.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const items = [];
      while (i < lines.length && (item.test(lines[i]) || (/^\s{2,}\S/.test(lines[i]) && items.length))) {
        if (item.test(lines[i])) items.push(lines[i].replace(item, ""));
        else items[items.length - 1] += " " + lines[i].trim();
        i++;
      }
      const tag = ordered ? "ol" : "ul";
      out.push(`<${tag}>${items.map((t) => `<li>${inline(t)}</li>`).join("")}</${tag}>`);
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !/^\s*(```|~~~|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(lines[i])) {
      para.push(inline(lines[i++]));
    }
    if (!para.length) para.push(inline(lines[i++]));
    out.push(`<p>${para.join("<br>")}</p>`);
  }
  return out.join("\n");
}
