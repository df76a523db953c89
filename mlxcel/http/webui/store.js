// Conversations and settings, kept in this browser's localStorage (the server stores nothing
// for the page). A conversation: {id, title, updated, messages: [{role, content, images,
// reasoning, toolCalls, stats, error}]}.

const CONVERSATIONS = "mlxcel.conversations";
const SETTINGS = "mlxcel.settings";
const SETTING_NAMES = ["system", "temperature", "top_p", "top_k", "max_tokens"];

function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(CONVERSATIONS) || "[]");
    return Array.isArray(list) ? list : [];
  } catch {
    return [];
  }
}

function saveConversations(list) {
  try {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(list));
  } catch {
    // Full storage (images are large): drop the oldest conversations until it fits.
    while (list.length > 1) {
      list.pop();
      try {
        localStorage.setItem(CONVERSATIONS, JSON.stringify(list));
        return;
      } catch { /* keep dropping */ }
    }
  }
}

function newConversation() {
  return { id: crypto.randomUUID(), title: "New chat", updated: Date.now(), messages: [] };
}

function loadSettings() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  } catch {
    return {};
  }
}

function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

// The request fields the settings set; empty ones are left to the server's defaults.
function samplingFields(settings) {
  const fields = {};
  for (const name of ["temperature", "top_p", "top_k", "max_tokens"]) {
    const value = settings[name];
    if (value !== undefined && value !== "" && !Number.isNaN(Number(value))) fields[name] = Number(value);
  }
  return fields;
}
