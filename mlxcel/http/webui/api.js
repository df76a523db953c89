// The server's HTTP API as the page uses it: the key (kept in this browser's storage, sent as a
// bearer token on every call), JSON GETs, and the chat stream read as server-sent events.

const CONFIG = JSON.parse(document.body.dataset.config);
const API = CONFIG.apiPrefix;
const KEY_STORAGE = "mlxcel.apiKey";

class AuthError extends Error {}

const apiKey = () => localStorage.getItem(KEY_STORAGE) || "";

function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body.error?.message || body.message || text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}

async function getJSON(path) {
  const response = await fetch(API + path, { headers: authHeaders() });
  if (response.status === 401) throw new AuthError("Invalid API key");
  if (!response.ok) {
    const error = new Error(await errorText(response));
    error.status = response.status;
    throw error;
  }
  return response.json();
}

// Yields each event's parsed JSON until [DONE]. Aborting `signal` closes the connection, and
// the server cancels the request (its slot is freed at the next step).
async function* chatStream(body, signal) {
  const response = await fetch(`${API}/v1/chat/completions`, {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (response.status === 401) throw new AuthError("Invalid API key");
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue; // a comment (keep-alive ping)
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "generation failed");
      yield chunk;
    }
  }
}
