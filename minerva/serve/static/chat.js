// The chat page of `minerva serve`: one conversation, kept in this browser's localStorage,
// answered by /v1/chat/completions as a stream. Stop aborts the request (the server frees its
// KV blocks when the connection closes). A reasoning model's reasoning_content is shown
// folded above its answer; each answer shows its tokens and tokens/s.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = "minerva.chat.v1";
  const FIELDS = { system: "system", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens",
                   api_key: "api-key" };
  let state = { messages: [], settings: {} };
  let controller = null;  // the answer streaming now
  let model = null;

  function load() {
    try { state = Object.assign(state, JSON.parse(localStorage.getItem(STORE) || "{}")); } catch (e) { /* fresh */ }
    for (const [key, id] of Object.entries(FIELDS)) {
      if (state.settings[key] !== undefined) $(id).value = state.settings[key];
    }
  }

  function save() {
    for (const [key, id] of Object.entries(FIELDS)) state.settings[key] = $(id).value;
    localStorage.setItem(STORE, JSON.stringify(state));
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if ($("api-key").value) h.Authorization = `Bearer ${$("api-key").value}`;
    return h;
  }

  function bubble(role) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    $("messages").appendChild(div);
    return div;
  }

  function showAssistant(div, message) {
    div.innerHTML = "";
    if (message.reasoning) {
      const details = document.createElement("details");
      details.innerHTML = `<summary>Reasoning</summary><div class="thinking">${escapeHtml(message.reasoning)}</div>`;
      div.appendChild(details);
    }
    const content = document.createElement("div");
    content.className = "content";
    content.innerHTML = renderMarkdown(message.content || "");
    div.appendChild(content);
    if (message.stats || message.error) {
      const stats = document.createElement("div");
      stats.className = message.error ? "stats error" : "stats";
      stats.textContent = message.error || message.stats;
      div.appendChild(stats);
    }
    $("messages").scrollTop = $("messages").scrollHeight;
  }

  function render() {
    $("messages").innerHTML = "";
    for (const m of state.messages) {
      if (m.role === "user") bubble("user").textContent = m.content;
      else showAssistant(bubble("assistant"), m);
    }
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").hidden = !on;
  }

  function requestBody() {
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    for (const m of state.messages) messages.push({ role: m.role, content: m.content || "" });
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (model) body.model = model;
    const number = (id) => (document.getElementById(id).value === "" ? undefined : Number($(id).value));
    if (number("temperature") !== undefined) body.temperature = number("temperature");
    if (number("top-p") !== undefined) body.top_p = number("top-p");
    if (number("max-tokens") !== undefined) body.max_tokens = number("max-tokens");
    return body;
  }

  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  async function send(text) {
    state.messages.push({ role: "user", content: text });
    bubble("user").textContent = text;
    const answer = { role: "assistant", content: "", reasoning: "" };
    const body = requestBody();
    state.messages.push(answer);
    save();
    const div = bubble("assistant");
    showAssistant(div, answer);
    controller = new AbortController();
    busy(true);
    const start = performance.now();
    let first = null, tokens = 0, queued = false;
    const redraw = () => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => { queued = false; showAssistant(div, answer); });
    };
    try {
      const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                             signal: controller.signal });
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
      }
      await readEvents(response, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content || delta.reasoning_content) first = first || performance.now();
          answer.content += delta.content || "";
          answer.reasoning += delta.reasoning_content || "";
          if (choice.finish_reason === "length") answer.cut = true;
        }
        redraw();
      });
      const seconds = (performance.now() - (first || start)) / 1000;
      answer.stats = `${tokens} tokens, ${seconds > 0 ? (Math.max(tokens - 1, 0) / seconds).toFixed(1) : "-"} tokens/s` +
        `, first token after ${(((first || performance.now()) - start) / 1000).toFixed(2)} s` +
        (answer.cut ? " (cut off at max tokens)" : "");
    } catch (e) {
      if (e.name === "AbortError") answer.stats = "[stopped]";
      else answer.error = `error: ${e.message}`;
      if (answer.error || !answer.content) {  // nothing to build on: the exchange leaves the conversation
        state.messages.splice(state.messages.length - 2, 2);
        if (answer.error) answer.error += " (not kept in the conversation)";
        else answer.stats += " (not kept in the conversation)";
      }
    } finally {
      controller = null;
      busy(false);
      save();
      showAssistant(div, answer);
    }
  }

  async function loadModel() {
    try {
      const response = await fetch("/v1/models", { headers: headers() });
      const data = await response.json();
      model = data.data[0].id;
      $("model").textContent = model;
    } catch (e) {
      $("model").textContent = "(no model: is the API key set?)";
    }
  }

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value;
    if (!text.trim() || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    state.messages = [];
    save();
    render();
  });
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
  for (const id of Object.values(FIELDS)) $(id).addEventListener("change", () => { save(); if (id === "api-key") loadModel(); });

  load();
  render();
  loadModel();
})();
