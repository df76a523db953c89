// Start-up: the API key (asked for when the server has keys), what the server offers (models,
// vision, voice), the settings form, and the composer's buttons.

function askForKey(rejected = false) {
  $("key-error").hidden = !rejected;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  localStorage.setItem(KEY_STORAGE, key);
  $("key-input").value = "";
  $("key-dialog").close();
  $("forget-key").hidden = false;
  discover();
});

// Without a key the page can do nothing: Escape does not dismiss the question.
$("key-dialog").addEventListener("cancel", (event) => event.preventDefault());

$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEY_STORAGE);
  $("forget-key").hidden = true;
  askForKey();
});

async function discover() {
  try {
    // /props needs the key where /v1/models does not: it tells whether the key is good.
    const props = await getJSON("/props");
    const models = await getJSON("/v1/models");
    const picker = $("model");
    const chosen = picker.value;
    // Only models that chat: not the speech, embedding or reranking models listed beside
    // them (a router's unloaded models say nothing yet, and may chat).
    const chat = models.data.filter((m) => !m.capabilities || m.capabilities.includes("completion"));
    picker.replaceChildren(...chat.map((m) => new Option(m.id, m.id)));
    if (chosen && chat.some((m) => m.id === chosen)) picker.value = chosen;
    $("attach").hidden = !props.modalities?.vision;
    const voice = props.capabilities?.speech_to_text && props.capabilities?.text_to_speech;
    $("talk-button").hidden = !voice;
    setStatus("");
    document.body.dataset.ready = "true";
  } catch (error) {
    if (error instanceof AuthError) {
      setStatus("API key needed");
      askForKey(Boolean(apiKey()));
    } else if (error.status === 503) {
      setStatus("Loading model\u2026");
      setTimeout(discover, 1000);
    } else {
      setStatus(`Server unreachable: ${error.message}`);
      setTimeout(discover, 3000);
    }
  }
}

function initSettings() {
  const settings = loadSettings();
  for (const name of SETTING_NAMES) {
    const input = $(`set-${name}`);
    input.value = settings[name] ?? "";
    input.addEventListener("change", () => {
      const now = loadSettings();
      now[name] = input.value;
      saveSettings(now);
    });
  }
  $("settings-button").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-button").setAttribute("aria-expanded", String(!panel.hidden));
  });
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", startConversation);
$("attach").addEventListener("click", () => $("image-input").click());
$("image-input").addEventListener("change", (event) => {
  attachImages(event.target.files);
  event.target.value = "";
});
$("talk-button").addEventListener("click", () => (talk.on ? stopTalk() : startTalk()));
$("talk-end").addEventListener("click", () => stopTalk());

initSettings();
$("forget-key").hidden = !apiKey();
startConversation();
if (CONFIG.keys && !apiKey()) {
  setStatus("API key needed");
  askForKey();
} else {
  discover();
}
