// The chat page. Each turn sends the whole conversation: the server continues the cache it kept
// for that prefix (the turn's "reused" says how many prompt tokens it did not prefill again).
// The answer streams; the last chunk's usage and kv give the turn's numbers, and /metrics the
// process's memory against its budget.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];
let policies = [];

function headers() {
  const key = $("key").value.trim();
  localStorage.setItem("infinikv-key", key);
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

// A fetch that throws the server's own error message for a 4xx/5xx.
async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: headers() });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message;
    } catch (_) {}
    throw new Error(message);
  }
  return response;
}

const mib = (bytes) => `${(bytes / 2 ** 20).toFixed(bytes < 10 * 2 ** 20 ? 2 : 0)} MiB`;
const chosen = () => policies.find((p) => p.name === $("policy").value);

async function load() {
  try {
    const [models, listing] = await Promise.all(["/v1/models", "/v1/policies"].map((p) => api(p).then((r) => r.json())));
    $("model").textContent = models.data[0].id;
    policies = listing.data;
    $("policy").replaceChildren(
      ...policies.map((p) => Object.assign(new Option(p.ready ? p.name : `${p.name} (not prepared)`, p.name), { disabled: !p.ready })),
    );
    $("policy").value = listing.default.policy;
    choose();
    await showMemory();
  } catch (error) {
    $("policy-note").textContent = error.message;
  }
}

function choose() {
  const policy = chosen();
  $("budget").value = policy.spec.budget ?? policy.spec.capacity ?? "";
  $("budget").disabled = !policy.takes_budget;
  $("policy-note").textContent = policy.summary;
}

// The request's kv: the chosen policy's spec with the budget field as a fraction or a capacity.
function kv() {
  const policy = chosen();
  const { budget, capacity, ...spec } = policy.spec;
  const text = $("budget").value.trim();
  if (policy.takes_budget && text) {
    const value = Number(text);
    if (!(value > 0)) throw new Error("budget: a fraction of the tokens (0.1) or a capacity in tokens (1024)");
    spec[text.includes(".") || value < 1 ? "budget" : "capacity"] = value;
  }
  return spec;
}

// Server-sent events of a streamed reply, as objects, up to [DONE].
async function* events(response) {
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
      if (!event.startsWith("data: ")) continue;
      if (event === "data: [DONE]") return;
      yield JSON.parse(event.slice(6));
    }
  }
}

function bubble(role, text) {
  const element = Object.assign(document.createElement("div"), { className: `message ${role}` });
  element.append(document.createTextNode(text));
  $("messages").append(element);
  element.scrollIntoView({ block: "end" });
  return element;
}

// The line under an answer: prompt tokens and how many were reused, K/V held, attended, speed.
function turnLine(usage, kv, started, first, finished) {
  const reused = usage.prompt_tokens_details.cached_tokens;
  const attended = kv.fetched_fraction === undefined ? "every token held" : `${(100 * kv.fetched_fraction).toFixed(1)}% of the tokens`;
  const speed = usage.completion_tokens > 1 ? ` · ${((usage.completion_tokens - 1) / ((finished - first) / 1000)).toFixed(1)} tokens/s` : "";
  const line = Object.assign(document.createElement("small"), { className: "turn" });
  line.textContent =
    `${usage.prompt_tokens} prompt tokens, ${reused} reused · K/V held ${mib(kv.kv_bytes)} (${kv.policy}) · attended ${attended}` +
    ` · ${usage.completion_tokens} tokens, first after ${((first - started) / 1000).toFixed(2)} s${speed}`;
  Object.assign(line.dataset, { prompt: usage.prompt_tokens, reused, held: kv.kv_bytes, policy: kv.policy });
  return line;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || $("send").disabled) return;
  $("prompt").value = "";
  $("send").disabled = true;
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  const answer = bubble("assistant", "");
  const started = performance.now();
  let first = started, usage, info, content = "";
  try {
    const body = {
      model: $("model").textContent,
      messages: conversation,
      max_tokens: Number($("max-tokens").value),
      temperature: Number($("temperature").value),
      stream: true,
      stream_options: { include_usage: true },
      kv: kv(),
    };
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body) });
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) [usage, info] = [chunk.usage, chunk.kv];
      const piece = chunk.choices[0]?.delta.content;
      if (piece) {
        if (!content) first = performance.now();
        content += piece;
        answer.firstChild.textContent = content;
      }
    }
    conversation.push({ role: "assistant", content });
    answer.append(turnLine(usage, info, started, first, performance.now()));
  } catch (error) {
    conversation.pop();
    $("prompt").value = text;
    answer.classList.add("error");
    answer.firstChild.textContent = error.message;
  } finally {
    $("send").disabled = false;
    showMemory().catch(() => {});
  }
}

// The process's resident memory against its budget, summed over the server's replicas.
async function showMemory() {
  const text = await (await api("/metrics")).text();
  const total = (name) =>
    text
      .split("\n")
      .filter((line) => line.startsWith(`${name} `) || line.startsWith(`${name}{`))
      .reduce((sum, line) => sum + Number(line.split(" ").pop()), 0);
  const [resident, budget] = [total("infinikv_resident_bytes"), total("infinikv_memory_bytes_budget")];
  const [kvHeld, kvBudget] = [total("infinikv_kv_bytes_in_use") + total("infinikv_kv_bytes_kept"), total("infinikv_kv_bytes_budget")];
  $("memory").textContent =
    `process ${mib(resident)}${budget ? ` of ${mib(budget)} (--memory)` : ""} · K/V ${mib(kvHeld)} of ${mib(kvBudget)}`;
  Object.assign($("memory").dataset, { resident, budget });
}

$("policy").addEventListener("change", choose);
$("key").addEventListener("change", load);
$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("new-chat").addEventListener("click", () => {
  conversation.length = 0;
  $("messages").replaceChildren();
});
$("key").value = localStorage.getItem("infinikv-key") || "";
load();
