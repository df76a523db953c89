// The chat view: the conversation list, the turns, sending and streaming an answer, stop,
// regenerate and edit. <body data-state> is "streaming" while an answer arrives.

const $ = (id) => document.getElementById(id);

const chat = {
  conversations: loadConversations(),
  current: null,
  controller: null,
  attachments: [], // data: URLs of images for the next message
};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text) {
  $("status").textContent = text;
}

function persist() {
  chat.current.updated = Date.now();
  chat.conversations.sort((a, b) => b.updated - a.updated);
  saveConversations(chat.conversations);
  renderConversationList();
}

function renderConversationList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of chat.conversations) {
    const li = el("li", conv === chat.current ? "current" : "");
    const title = el("span", "", conv.title);
    title.title = conv.title;
    title.addEventListener("click", () => openConversation(conv));
    const remove = el("button", "", "\u00d7");
    remove.title = "Delete this conversation";
    remove.addEventListener("click", () => deleteConversation(conv));
    li.append(title, remove);
    list.append(li);
  }
}

function openConversation(conv) {
  if (chat.controller) return; // finish or stop the answer first
  chat.current = conv;
  renderConversationList();
  renderMessages();
}

function deleteConversation(conv) {
  chat.conversations = chat.conversations.filter((c) => c !== conv);
  saveConversations(chat.conversations);
  if (conv === chat.current) startConversation();
  else renderConversationList();
}

function startConversation() {
  if (chat.controller) return;
  const empty = chat.conversations.find((c) => !c.messages.length);
  chat.current = empty || newConversation();
  if (!empty) chat.conversations.unshift(chat.current);
  renderConversationList();
  renderMessages();
  $("prompt").focus();
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...chat.current.messages.map((m, i) => renderMessage(m, i)));
  box.scrollTop = box.scrollHeight;
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.tokens) parts.push(`${stats.tokens} tokens`);
  if (stats.speed) parts.push(`${stats.speed.toFixed(1)} tok/s`);
  if (stats.stopped) parts.push("stopped");
  return parts.join(" \u00b7 ");
}

function renderMessage(message, index) {
  const node = el("div", `msg ${message.role}`);
  node.dataset.index = index;
  node.append(el("div", "who", message.role === "user" ? "You" : "Assistant"));
  if (message.reasoning) {
    const details = el("details", "reasoning");
    details.append(el("summary", "", "Reasoning"), el("div", "", message.reasoning));
    node.append(details);
  }
  const body = el("div", "body");
  if (message.role === "user") {
    for (const src of message.images || []) {
      const img = el("img");
      img.src = src;
      img.alt = "attached image";
      body.append(img);
    }
    body.append(document.createTextNode(message.content));
  } else {
    // renderMarkdown escapes every piece of the answer before it adds any tag.
    body.innerHTML = renderMarkdown(message.content || "");
  }
  node.append(body);
  for (const call of message.toolCalls || []) {
    node.append(el("div", "tool-call", `\u2192 ${call.name}(${call.arguments})`));
  }
  if (message.error) node.append(el("div", "error", message.error));
  const actions = el("div", "actions");
  actions.append(el("span", "stats", statsText(message.stats)));
  const last = index === chat.current.messages.length - 1;
  if (message.role === "assistant" && last) {
    const again = el("button", "regenerate", "Regenerate");
    again.addEventListener("click", () => regenerate());
    actions.append(again);
  }
  if (message.role === "user") {
    const edit = el("button", "edit", "Edit");
    edit.addEventListener("click", () => editTurn(node, index));
    actions.append(edit);
  }
  node.append(actions);
  return node;
}

function editTurn(node, index) {
  if (chat.controller) return;
  const message = chat.current.messages[index];
  const area = el("textarea");
  area.value = message.content;
  const save = el("button", "", "Save & send");
  const cancel = el("button", "", "Cancel");
  save.addEventListener("click", () => {
    message.content = area.value;
    chat.current.messages.length = index + 1; // the answers to the old wording go
    persist();
    answer();
  });
  cancel.addEventListener("click", () => renderMessages());
  const actions = el("div", "actions");
  actions.append(save, cancel);
  node.querySelector(".body").replaceWith(area);
  node.querySelector(".actions").replaceWith(actions);
  area.focus();
}

function regenerate() {
  if (chat.controller) return;
  const messages = chat.current.messages;
  if (messages.at(-1)?.role === "assistant") messages.pop();
  answer();
}

function wireMessages() {
  const settings = loadSettings();
  const out = [];
  if (settings.system) out.push({ role: "system", content: settings.system });
  for (const m of chat.current.messages) {
    if (m.role === "user" && m.images?.length) {
      out.push({
        role: "user",
        content: [
          ...m.images.map((url) => ({ type: "image_url", image_url: { url } })),
          { type: "text", text: m.content },
        ],
      });
    } else if (m.role === "user" || m.content) {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

async function send(text) {
  if (chat.controller || (!text.trim() && !chat.attachments.length)) return;
  const message = { role: "user", content: text };
  if (chat.attachments.length) message.images = chat.attachments;
  chat.attachments = [];
  $("attachments").replaceChildren();
  chat.current.messages.push(message);
  if (chat.current.title === "New chat") chat.current.title = text.slice(0, 60) || "Image";
  persist();
  await answer();
}

function setStreaming(on) {
  document.body.dataset.state = on ? "streaming" : "idle";
  $("send").hidden = on;
  $("stop").hidden = !on;
}

async function answer() {
  const conv = chat.current;
  const message = { role: "assistant", content: "", reasoning: "", toolCalls: [] };
  conv.messages.push(message);
  renderMessages();
  const node = $("messages").lastElementChild;
  const controller = new AbortController();
  chat.controller = controller;
  setStreaming(true);
  const started = performance.now();
  let firstToken = 0;
  let pending = false;
  const paint = () => {
    pending = false;
    const fresh = renderMessage(message, conv.messages.length - 1);
    // Reasoning opened while it streams stays open.
    if (node.querySelector("details.reasoning")?.open) fresh.querySelector("details.reasoning").open = true;
    node.replaceChildren(...fresh.childNodes);
    const box = $("messages");
    if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  };
  // Repaint at most once a frame, however fast tokens arrive.
  const schedule = () => {
    if (!pending) {
      pending = true;
      requestAnimationFrame(paint);
    }
  };
  let usage = null;
  let timings = null;
  try {
    const body = {
      model: $("model").value || undefined,
      messages: wireMessages(),
      ...samplingFields(loadSettings()),
    };
    for await (const chunk of chatStream(body, controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      if (chunk.timings) timings = chunk.timings;
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      if (!firstToken && (delta.content || delta.reasoning_content)) firstToken = performance.now();
      if (delta.content) message.content += delta.content;
      if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls || []) {
        const slot = (message.toolCalls[call.index ?? 0] ||= { name: "", arguments: "" });
        if (call.function?.name) slot.name += call.function.name;
        if (call.function?.arguments) slot.arguments += call.function.arguments;
      }
      schedule();
    }
  } catch (error) {
    if (error.name === "AbortError") message.stopped = true;
    else if (error instanceof AuthError) {
      message.error = "The server did not accept the API key.";
      askForKey(true);
    } else message.error = String(error.message || error);
  } finally {
    chat.controller = null;
    setStreaming(false);
  }
  const tokens = usage?.completion_tokens ?? timings?.predicted_n;
  let speed = timings?.predicted_per_second;
  if (!speed && tokens && firstToken) speed = (tokens * 1000) / Math.max(1, performance.now() - firstToken);
  message.stats = { tokens, speed, stopped: Boolean(message.stopped), ms: performance.now() - started };
  if (!message.reasoning) delete message.reasoning;
  if (!message.toolCalls.length) delete message.toolCalls;
  persist();
  if (conv === chat.current) renderMessages();
}

function stop() {
  chat.controller?.abort();
}

function attachImages(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => {
      chat.attachments.push(reader.result);
      const img = el("img");
      img.src = reader.result;
      img.alt = file.name;
      $("attachments").append(img);
    };
    reader.readAsDataURL(file);
  }
}
