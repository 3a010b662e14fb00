// Chat playground over the websocket API (/ws/v1/chat). The key is sent in the first message
// rather than as a subprotocol, so it never appears in request headers or proxy logs.
(function () {
  "use strict";
  var root = document.getElementById("playground");
  if (!root) return;

  var $ = function (id) { return document.getElementById(id); };
  var keyInput = $("pg-key"), modelSelect = $("pg-model"), maxTokens = $("pg-max-tokens");
  var temperature = $("pg-temperature"), systemPrompt = $("pg-system"), transcript = $("pg-transcript");
  var input = $("pg-input"), form = $("pg-form"), sendButton = $("pg-send"), cancelButton = $("pg-cancel");
  var statusLine = $("pg-status"), clearButton = $("pg-clear");

  var storageKey = "pagoda.playground.key:" + location.pathname;
  keyInput.value = sessionStorage.getItem(storageKey) || "";
  keyInput.addEventListener("change", function () { sessionStorage.setItem(storageKey, keyInput.value.trim()); });

  var socket = null, socketKey = null, ready = null;
  var history = [];      // {role, content} turns sent with every request
  var active = null;     // the stream in flight: {id, bubble, text}
  var counter = 0;

  function setStatus(text, isError) {
    statusLine.textContent = text;
    statusLine.classList.toggle("pg-status-error", !!isError);
  }

  function bubble(kind, text) {
    var empty = $("pg-empty");
    if (empty) empty.remove();
    var node = document.createElement("div");
    node.className = "msg msg-" + kind;
    node.textContent = text || "";
    transcript.appendChild(node);
    transcript.scrollTop = transcript.scrollHeight;
    return node;
  }

  function meta(node, text) {
    var line = document.createElement("div");
    line.className = "msg-meta";
    line.textContent = text;
    node.insertAdjacentElement("afterend", line);
    transcript.scrollTop = transcript.scrollHeight;
  }

  function setBusy(busy) {
    sendButton.disabled = busy;
    cancelButton.disabled = !busy;
  }

  function finish(text, keepTurn) {
    if (!active) return;
    active.bubble.classList.remove("streaming");
    if (keepTurn && active.text) history.push({ role: "assistant", content: active.text });
    meta(active.bubble, text);
    active = null;
    setBusy(false);
    input.focus();
  }

  function fail(message) {
    if (active) {
      // Partial text stays on screen but leaves the conversation, with the turn it answered.
      active.bubble.classList.remove("streaming");
      if (!active.text) active.bubble.remove();
      active = null;
      history.pop();
    }
    bubble("error", message).id = "pg-last-error";
    setStatus(message, true);
    setBusy(false);
  }

  function usageText(usage) {
    if (!usage) return "";
    return usage.prompt_tokens + " prompt + " + usage.completion_tokens + " completion tokens";
  }

  function onMessage(event) {
    var message;
    try { message = JSON.parse(event.data); } catch (e) { return; }
    if (message.type === "authenticated") {
      ready && ready.resolve();
      return;
    }
    if (message.type === "error" && message.id == null) {
      // Authentication failures and malformed frames carry no stream id.
      var text = (message.error && message.error.message) || "Error";
      if (ready) ready.reject(new Error(text)); else fail(text);
      return;
    }
    if (!active || message.id !== active.id) return;
    if (message.type === "delta") {
      if (message.index === 0 && message.content) {
        active.text += message.content;
        active.bubble.textContent = active.text;
        transcript.scrollTop = transcript.scrollHeight;
        setStatus("Streaming… " + active.text.length + " characters");
      }
    } else if (message.type === "done") {
      finish(usageText(message.usage) + " · " + message.finish_reason, true);
      setStatus("Done.");
    } else if (message.type === "cancelled") {
      finish("Cancelled · " + usageText(message.usage), true);
      setStatus("Cancelled.");
    } else if (message.type === "error") {
      fail((message.error && message.error.message) || "The request failed.");
    }
  }

  function connect(key) {
    if (socket && socketKey === key && socket.readyState === WebSocket.OPEN) return Promise.resolve();
    if (socket) socket.close();
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + root.getAttribute("data-ws-path"), ["pagoda.v1"]);
    socketKey = key;
    setStatus("Connecting…");
    var pending = {};
    var promise = new Promise(function (resolve, reject) { pending.resolve = resolve; pending.reject = reject; });
    ready = pending;
    var current = socket;
    socket.onopen = function () { current.send(JSON.stringify({ type: "auth", api_key: key })); };
    socket.onmessage = onMessage;
    socket.onclose = function (event) {
      if (current !== socket) return;
      socket = null;
      if (ready) { ready.reject(new Error(event.code === 4401 ? "The API key was refused." : "Could not connect.")); }
      else if (active) { fail("The connection closed."); }
      else { setStatus("Disconnected."); }
    };
    return promise.then(
      function () { ready = null; setStatus("Connected."); },
      function (error) { ready = null; if (current === socket) socket.close(); throw error; }
    );
  }

  function send() {
    var text = input.value.trim();
    var key = keyInput.value.trim();
    if (!text || active) return;
    if (!key) { setStatus("Paste an API key of this tenant first.", true); keyInput.focus(); return; }
    sessionStorage.setItem(storageKey, key);
    history.push({ role: "user", content: text });
    bubble("user", text);
    input.value = "";
    var id = "pg-" + Date.now().toString(36) + "-" + (++counter);
    active = { id: id, bubble: bubble("assistant"), text: "" };
    active.bubble.classList.add("streaming");
    setBusy(true);
    var messages = history.slice();
    if (systemPrompt.value.trim()) messages.unshift({ role: "system", content: systemPrompt.value.trim() });
    var request = {
      model: modelSelect.value,
      messages: messages,
      max_tokens: parseInt(maxTokens.value, 10) || 64,
      temperature: parseFloat(temperature.value)
    };
    if (isNaN(request.temperature)) delete request.temperature;
    connect(key).then(function () {
      if (!active || active.id !== id) return;
      if (active.cancelled) { finish("Cancelled", false); history.pop(); setStatus("Cancelled."); return; }
      setStatus("Waiting for the first token…");
      active.sent = true;
      socket.send(JSON.stringify({ type: "chat", id: id, request: request }));
    }, function (error) { fail(error.message); });
  }

  form.addEventListener("submit", function (event) { event.preventDefault(); send(); });
  input.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); send(); }
  });
  cancelButton.addEventListener("click", function () {
    if (!active) return;
    var id = active.id;
    active.cancelled = true;
    if (!active.sent || !socket) return;  // send() sees the flag before the request goes out
    socket.send(JSON.stringify({ type: "cancel", id: id }));
    setStatus("Cancelling…");
    // A stream cancelled before it was admitted gets no reply: do not wait on it forever.
    setTimeout(function () {
      if (active && active.id === id) { finish("Cancelled", true); setStatus("Cancelled."); }
    }, 3000);
  });
  clearButton.addEventListener("click", function () {
    if (active) return;
    history = [];
    transcript.innerHTML = '<p class="pg-empty muted" id="pg-empty">Send a message to start.</p>';
    setStatus(socket ? "Connected." : "Not connected.");
  });
})();
