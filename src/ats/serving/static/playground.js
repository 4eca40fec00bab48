// ats playground: a client of the server's own API (no framework, no build step, works offline). One page for both
// servers: `ats serve` and `ats serve --engine vllm` (whose middleware serves these files); GET /v1/playground says
// what the server offers, and what it cannot show (`unavailable`: feature -> one-line reason) is disabled and said.
// Safety rule: no text from a user, the model or the server is ever parsed as HTML: every node is built with
// document.createElement and filled with textContent (see el()); nothing here uses innerHTML.
"use strict";

const KEY_STORE = "ats-playground-key";
const TOP_K = 5;
const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  info: null,
  unavailable: {}, // feature ("raw", "tau", "rescore", "evaluation") -> why this server cannot show it
  calibrator: null, // id of the calibrator the page shows
  shade: "calibrated",
  messages: [], // the chat so far, as sent to /v1/chat/completions
  turns: [], // assistant answers: {tokens, promptIds, byCal, spans, answerEl, cursor}
  controller: null,
  monitor: null, // GET /v1/ats/monitor after the last answer: the served certificate's decisions, counted
};

// --- small helpers -------------------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
const $ = (id) => document.getElementById(id);
const fmt = (p, digits = 3) => (p === null || p === undefined || !isFinite(p) ? "–" : Number(p).toFixed(digits));
const pct = (p, digits = 1) => (p === null || p === undefined || !isFinite(p) ? "–" : (100 * p).toFixed(digits) + "%");
const first = (obj, ...names) => { for (const n of names) if (obj && obj[n] !== undefined) return obj[n]; return undefined; };
function setStatus(text, error) { const s = $("status"); s.textContent = text; s.className = error ? "status error" : "status"; }

// The shading: a probability p in [0, 1] -> "rgb(r, g, b)", linear between colour stops (red where the model is
// unsure, plain where it is sure). tests/serving/test_playground_browser.py recomputes it independently.
const STOPS = [[0.0, [226, 92, 78]], [0.5, [247, 196, 112]], [0.8, [252, 236, 180]], [1.0, [246, 249, 252]]];
function shade(p) {
  const x = Math.min(1, Math.max(0, p));
  for (let i = 1; i < STOPS.length; i++) {
    const [p0, c0] = STOPS[i - 1], [p1, c1] = STOPS[i];
    if (x <= p1) {
      const t = (x - p0) / (p1 - p0);
      const c = c0.map((v, j) => Math.floor(v + t * (c1[j] - v) + 0.5));
      return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
    }
  }
  return "rgb(246, 249, 252)";
}
window.atsShade = shade; // for a person in the console

// --- the API -------------------------------------------------------------------------------------------------------
class Unauthorized extends Error {}
async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.key) headers["Authorization"] = "Bearer " + state.key;
  if (options.json !== undefined) { headers["Content-Type"] = "application/json"; options.body = JSON.stringify(options.json); }
  const response = await fetch(path, { method: options.method || (options.json !== undefined ? "POST" : "GET"),
                                       headers, body: options.body, signal: options.signal });
  if (response.status === 401) { askKey(state.key ? "That key was refused." : ""); throw new Unauthorized("API key needed"); }
  if (!response.ok && !options.raw) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message || message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

function askKey(message) {
  $("app").hidden = true;
  $("key-panel").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

// --- start-up ------------------------------------------------------------------------------------------------------
async function load() {
  let info;
  try {
    info = await (await api("/v1/playground")).json();
  } catch (err) {
    if (!(err instanceof Unauthorized)) { $("model-line").textContent = "could not reach the server: " + err.message; }
    return;
  }
  state.info = info;
  state.unavailable = info.unavailable || {};
  state.calibrator = state.calibrator || info.served;
  $("key-panel").hidden = true;
  $("app").hidden = false;
  $("model-line").textContent = `model ${info.model}, generating with calibrator ${info.served}` +
    (info.engine === "vllm" ? " in vLLM" : "");
  showUnavailable();
  useCertifiedLength(info.certified_format);
  const select = $("calibrator");
  select.replaceChildren(...info.calibrators.map((c) =>
    el("option", { value: c.id }, c.id === info.served ? `${c.id} (generates)` : `${c.id} (rescored)`)));
  select.value = state.calibrator;
  select.disabled = info.calibrators.length < 2;
  select.title = state.unavailable.rescore || (select.disabled ? "start the server with --compare CALIBRATOR "
    + "(repeatable) to compare calibrators on the same tokens" : "rescore the same tokens under another loaded calibrator");
  const ramp = $("ramp");
  ramp.style.background = "linear-gradient(to right, " + [0, 0.25, 0.5, 0.65, 0.8, 0.9, 1].map(shade).join(", ") + ")";
  renderRecord();
  document.body.dataset.ready = "true";
}

// The max tokens start at the certified limit (with temperature 0: greedy), so that the page's answers are by default
// the ones the threshold's certificate covers (any other length is outside it: the verdict says so).
function useCertifiedLength(format) {
  const input = $("max-tokens");
  if (!format || !Number.isInteger(format.max_tokens) || input.dataset.set) return;
  input.value = String(format.max_tokens);
  input.dataset.set = "certified";
  input.title = "the certified limit: answers cut at another length are outside the certificate";
}

const FEATURE_NAMES = { raw: "Raw probabilities", tau: "Tau", rescore: "Comparing calibrators",
                        evaluation: "The saved evaluation", training: "The training record" };
function showUnavailable() {
  const missing = state.unavailable;
  const raw = document.querySelector("input[name=shade][value=raw]");
  raw.disabled = Boolean(missing.raw);
  $("raw-choice").title = missing.raw || "";
  if (missing.raw && state.shade === "raw") {
    state.shade = "calibrated";
    document.querySelector("input[name=shade][value=calibrated]").checked = true;
  }
  const list = $("unavailable");
  list.replaceChildren(...Object.entries(missing).map(([name, reason]) =>
    el("li", { "data-feature": name }, `${FEATURE_NAMES[name] || name}: not on this server: ${reason}.`)));
  list.hidden = !list.children.length;
}

// --- chat ------------------------------------------------------------------------------------------------------------
function addUserTurn(text) {
  const item = el("li", { class: "turn user" }, el("span", { class: "who" }, "you"), el("span", { class: "text" }, text));
  $("transcript").append(item);
}

function addAssistantTurn() {
  const index = state.turns.length;
  const answer = el("span", { class: "answer", tabindex: "0", role: "group",
                               "aria-label": `answer ${index + 1}: move between tokens with the left and right arrows` });
  const item = el("li", { class: "turn assistant" }, el("span", { class: "who" }, "model"), answer);
  $("transcript").append(item);
  const turn = { index, tokens: [], promptIds: null, byCal: {}, summary: {}, answerEl: answer, cursor: -1, done: false };
  answer.addEventListener("keydown", (event) => onAnswerKey(turn, event));
  answer.addEventListener("focus", () => { if (turn.cursor < 0 && turn.tokens.length) moveCursor(turn, 0); });
  state.turns.push(turn);
  return turn;
}

// One chunk's tokens: a span per token. When their own strings spell the chunk's text, each shows its string;
// otherwise (a character split over tokens) the first shows the chunk's text and the others are thin marks.
// `ats serve` gives each token's confidence, raw logprob, tau and id in the chunk's `ats` field; vLLM's stream gives
// the calibrated logprob only, and its confidence is exp(logprob) (only calibrators of the logits run in vLLM).
function addTokens(turn, text, entries, ats) {
  const ids = ats.token_ids || [];
  const joined = entries.map((e) => e.token).join("");
  const count = ids.length || entries.length;
  for (let i = 0; i < count; i++) {
    const entry = entries[i] || {};
    const token = {
      i: turn.tokens.length, id: i < ids.length ? ids[i] : null, text: joined === text ? entry.token : (i === 0 ? text : ""),
      label: entry.token === undefined ? null : entry.token, // the token decoded on its own (e.g. "<|im_end|>")
      raw: ats.uncalibrated_logprobs ? ats.uncalibrated_logprobs[i] : null,
      served: { confidence: ats.confidence ? ats.confidence[i] : Math.exp(entry.logprob), logprob: entry.logprob,
                tau: ats.tau ? ats.tau[i] : null,
                top: (entry.top_logprobs || []).map((t) => ({ text: t.token, logprob: t.logprob })) },
    };
    const span = el("span", { class: token.text === "" ? "tok joined" : "tok", "data-index": token.i }, token.text);
    span.addEventListener("mouseenter", () => showToken(turn, token.i));
    span.addEventListener("click", () => moveCursor(turn, token.i));
    token.span = span;
    turn.tokens.push(token);
    turn.answerEl.append(span);
    paintToken(turn, token);
  }
  if (!count && text) turn.answerEl.append(document.createTextNode(text));
}

// What a token shows under the chosen calibrator: the stream's values for the one that generated, else the rescore.
function calValues(turn, token) {
  if (state.calibrator === state.info.served) {
    const extra = turn.byCal[state.calibrator];
    const top = extra ? extra.tokens[token.i].top : token.served.top;
    return { confidence: token.served.confidence, logprob: token.served.logprob, tau: token.served.tau, top };
  }
  const rescored = turn.byCal[state.calibrator];
  return rescored ? rescored.tokens[token.i] : null;
}

function paintToken(turn, token) {
  const values = calValues(turn, token);
  const raw = token.raw === null ? null : Math.exp(token.raw);
  const span = token.span;
  span.dataset.raw = raw === null ? "" : String(raw);
  span.dataset.calibrator = state.calibrator;
  if (values) span.dataset.confidence = String(values.confidence); else delete span.dataset.confidence;
  const p = state.shade === "raw" ? raw : values ? values.confidence : null;
  span.dataset.p = p === null ? "" : String(p);
  span.style.backgroundColor = p === null ? "" : shade(p);
  span.title = `${state.shade === "raw" ? "raw" : "calibrated"} probability ${fmt(p)}`;
}

function repaint() {
  for (const turn of state.turns) for (const token of turn.tokens) paintToken(turn, token);
  renderVerdict();
  const turn = state.turns[state.turns.length - 1];
  if (turn && turn.cursor >= 0) showToken(turn, turn.cursor);
}

async function send(text) {
  if (state.controller) return;
  const info = state.info;
  state.messages.push({ role: "user", content: text });
  addUserTurn(text);
  const turn = addAssistantTurn();
  const messages = state.messages.slice();
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true; $("stop").disabled = false;
  document.body.dataset.streaming = "true";
  setStatus("generating…");
  let content = "";
  try {
    const tokenized = state.unavailable.rescore ? null  // the prompt's ids serve only rescoring
      : api("/tokenize", { json: { model: info.model, messages } }).then((r) => r.json());
    const body = { model: info.model, messages, stream: true, logprobs: true, top_logprobs: TOP_K,
                   max_tokens: Number($("max-tokens").value) || 96, temperature: Number($("temperature").value) || 0 };
    const response = await api("/v1/chat/completions", { json: body, signal: controller.signal });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split(/\r?\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const text = (choice.delta && choice.delta.content) || "";
        content += text;
        const ats = choice.ats || {};
        const entries = (choice.logprobs && choice.logprobs.content) || [];
        if ((ats.token_ids || []).length || entries.length || text) addTokens(turn, text, entries, ats);
        if (choice.finish_reason) {
          turn.summary[info.served] = ats;
          turn.finish = choice.finish_reason;
        }
      }
    }
    state.messages.push({ role: "assistant", content });
    turn.promptIds = tokenized ? (await tokenized).tokens : null;
    turn.done = true;
    await readMonitor(turn.summary[info.served]);
    if (!state.unavailable.rescore) {
      setStatus("rescoring the tokens' alternatives…");
      await rescoreTurn(turn, info.served);
      if (state.calibrator !== info.served) await rescoreTurn(turn, state.calibrator);
    }
    setStatus(`${turn.tokens.length} tokens (${turn.finish === "length" ? "stopped at max tokens" : "finished"}).`);
  } catch (err) {
    if (err.name === "AbortError") { setStatus("stopped."); state.messages.push({ role: "assistant", content }); }
    else {
      if (!turn.tokens.length) state.messages.pop(); // nothing came back: the question is not part of the chat
      else state.messages.push({ role: "assistant", content });
      if (!(err instanceof Unauthorized)) setStatus("error: " + err.message, true);
    }
  } finally {
    state.controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    document.body.dataset.streaming = "false";
    document.body.dataset.turns = String(state.turns.filter((t) => t.done).length);
  }
  repaint();
}

async function rescoreTurn(turn, calibratorId) {
  if (!turn.done || !turn.tokens.length || turn.byCal[calibratorId] || state.unavailable.rescore) return;
  const body = { model: state.info.model, calibrator: calibratorId, prompt_tokens: turn.promptIds,
                 tokens: turn.tokens.map((t) => t.id), top_logprobs: TOP_K };
  const result = await (await api("/v1/playground/rescore", { json: body })).json();
  turn.byCal[calibratorId] = result;
  if (calibratorId !== state.info.served) turn.summary[calibratorId] = result.ats;
}

// --- the verdict ---------------------------------------------------------------------------------------------------
// The server's count of its decisions (GET /v1/ats/monitor, both servers): read after each answer it decided.
async function readMonitor(summary) {
  if (!summary || summary.answered === undefined) { state.monitor = null; return; }
  try { state.monitor = await (await api("/v1/ats/monitor")).json(); }
  catch (err) { state.monitor = null; if (err instanceof Unauthorized) throw err; }
}

function monitorWords(m) {
  const served = m.served["true"], certified = m.certified, shift = m.shift;
  const interval = (pair) => `${pct(pair[0])} to ${pct(pair[1])}`;
  const counted = served.answers
    ? `Since this server started it answered ${served.answered} of the ${served.answers} answers it made in the ` +
      `certified format (${pct(served.coverage)}; its rate is within ${interval(shift.served_interval)}, an interval ` +
      "that holds however often this is read); "
    : "This server has made no answer in the certified format yet; ";
  const verdict = shift.alarm
    ? " The two disagree: the questions asked here are not answered as the certified ones were, so they are not " +
      "drawn like them, and the guarantee does not cover them. Certify on questions like these."
    : " No sign so far that the questions asked here differ from the certified ones (which does not prove they do " +
      "not).";
  return counted + `on the certification questions it answered ${pct(certified.coverage)} ` +
    `(${interval(certified.coverage_interval)}).` + verdict;
}

function thresholdWords(t) {
  const risk = first(t, "target_risk", "alpha"), delta = t.delta;
  if (t.threshold === null || t.threshold === undefined) {
    return `No threshold could be certified at target risk ${pct(risk, 0)} (delta ${fmt(delta, 2)}) on ${t.n} labelled ` +
           "answers, so this calibrator abstains on every answer.";
  }
  return `Checked on ${t.n} labelled answers the calibrator was not trained on: answering only when the confidence ` +
         `is at least ${fmt(t.threshold)} answered ${pct(t.coverage)} of them (the coverage), and ${pct(t.risk)} ` +
         `of those answers were wrong. The threshold is certified so that at most ${pct(risk, 0)} of the answers it ` +
         `lets through are wrong (the target risk), and this guarantee itself fails with probability at most ` +
         `${pct(delta, 0)} (delta). It holds for questions like those it was checked on, not for other kinds.`;
}

function renderVerdict() {
  const box = $("verdict");
  const turn = [...state.turns].reverse().find((t) => t.done);
  const summary = turn && turn.summary[state.calibrator];
  if (!summary) {
    box.replaceChildren(el("p", { class: "muted" }, turn ? "rescoring…" : "No answer yet."));
    box.dataset.answered = "none";
    return;
  }
  const cal = state.info.calibrators.find((c) => c.id === state.calibrator);
  const conf = summary.answer_confidence;
  const parts = [];
  box.dataset.answerConfidence = conf === null || conf === undefined ? "" : String(conf);
  box.dataset.calibrator = state.calibrator;
  if (summary.answered === undefined) {
    box.dataset.answered = "none";
    parts.push(el("p", { class: "decision none" }, "No decision"),
               cal.make_threshold
                 ? el("p", {}, "No certified threshold is loaded for this calibrator. Make one (it writes " +
                      "threshold.json into the calibrator's folder):", el("pre", {}, cal.make_threshold))
                 : el("p", {}, "The model's own probabilities have no folder to hold a certified threshold."));
  } else {
    const answered = summary.answered;
    box.dataset.answered = String(answered);
    const threshold = first(summary, "threshold");
    parts.push(el("p", { class: "decision " + (answered ? "answer" : "abstain"), id: "decision" },
                  answered ? "Answer" : "Abstain"),
               el("p", {}, answered
                 ? `The answer's confidence ${fmt(conf)} is at or above the certified threshold ${fmt(threshold)}.`
                 : threshold === null || threshold === undefined
                   ? "No threshold was certified: this calibrator abstains on every answer."
                   : `The answer's confidence ${fmt(conf)} is below the certified threshold ${fmt(threshold)}: ` +
                     "the calibrator cannot vouch for it."));
    if (summary.certified_format === false) {
      parts.push(el("p", { class: "outside", id: "outside-certificate" }, "Outside the certified format: ",
                    summary.outside_certificate, ". The decision holds only for answers made as the certified ones were."));
    }
    if (cal.threshold) parts.push(el("p", { class: "muted" }, thresholdWords(cal.threshold)));
    const m = state.monitor;
    if (m && state.calibrator === state.info.served) {
      parts.push(el("p", { class: m.shift.alarm ? "outside" : "muted", id: "monitor",
                           "data-alarm": String(m.shift.alarm), "data-answers": String(m.served["true"].answers),
                           "data-answered": String(m.served["true"].answered) }, monitorWords(m)));
    }
  }
  box.dataset.certifiedFormat = summary.certified_format === undefined ? "none" : String(summary.certified_format);
  const figures = [["answer confidence", conf, "answer-confidence"],
                   // every generated token, the end token too: the answer confidence leaves a final end token out
                   ["mean probability of all generated tokens, calibrated", summary.mean_confidence],
                   ["mean probability of all generated tokens, raw", summary.mean_uncalibrated]]
    .filter(([, value, id]) => id || value !== undefined) // vLLM's `ats` field has the answer confidence only
    .flatMap(([name, value, id]) => [el("dt", {}, name), el("dd", { id }, fmt(value))]);
  parts.push(el("dl", { class: "figures" }, ...figures,
    el("dt", {}, "calibrator"), el("dd", {}, `${state.calibrator} (${summary.confidence_kind || cal.confidence_kind})`)));
  const kind = summary.confidence_kind || cal.confidence_kind;
  const source = kind === "probe"
    ? "The answer confidence is the correctness probe's P(correct): read from the model's hidden states at the " +
      "answer, not from its token probabilities. "
    : "The answer confidence is the mean calibrated probability of the answer's tokens, a final end token left " +
      "out (as ats eval scores free-form answers); the two means above take every generated token. ";
  parts.push(el("p", { class: "muted" }, source + "If the calibrator is calibrated for questions like this one, " +
    `answers given with confidence ${fmt(conf, 2)} are right about ${pct(conf, 0)} of the time; the calibrator's ` +
    "record says how well that held on the tasks it was evaluated on."));
  box.replaceChildren(...parts);
}

// --- one token -----------------------------------------------------------------------------------------------------
function showToken(turn, i) {
  const token = turn.tokens[i];
  if (!token) return;
  const values = calValues(turn, token);
  const raw = token.raw === null ? null : Math.exp(token.raw);
  const missing = state.unavailable;
  const rows = [];
  const rawTop = turn.byCal[state.info.served];
  const alternatives = values ? values.top : [];
  alternatives.forEach((alt, j) => {
    let rawLp = alt.uncalibrated_logprob;
    if (rawLp === undefined && rawTop) rawLp = rawTop.tokens[i].top[j] && rawTop.tokens[i].top[j].uncalibrated_logprob;
    const pc = Math.exp(alt.logprob), pr = rawLp === undefined ? null : Math.exp(rawLp);
    rows.push(el("tr", { class: alt.text === (token.label === null ? token.text : token.label) ? "chosen" : null },
      el("td", {}, el("code", {}, JSON.stringify(alt.text))),
      el("td", { class: "num" }, fmt(pc), " ", el("span", { class: "bar", style: `width:${(3 * pc).toFixed(2)}rem` })),
      el("td", { class: "num" }, missing.raw ? "n/a" : pr === null ? "…" : fmt(pr), " ",
         pr === null ? null : el("span", { class: "bar raw", style: `width:${(3 * pr).toFixed(2)}rem` }))));
  });
  const tau = values ? values.tau : null;
  $("token-detail").replaceChildren(
    el("p", {}, "token ", el("code", { id: "token-text" }, JSON.stringify(token.label === null ? token.text : token.label)),
       token.text === "" ? " (not shown in the text)" : null,
       ` #${i + 1} of answer ${turn.index + 1}`),
    el("dl", { class: "figures" },
      el("dt", {}, "calibrated probability"), el("dd", { id: "token-calibrated" }, values ? fmt(values.confidence) : "…"),
      el("dt", {}, "raw probability"), el("dd", { id: "token-raw" }, raw === null ? `n/a: ${missing.raw}` : fmt(raw)),
      el("dt", {}, "tau (log 1/T)"), el("dd", {}, missing.tau ? `n/a: ${missing.tau}`
        : tau === null || tau === undefined ? "none (this calibrator has no per-token tau)"
          : `${fmt(tau)}  (temperature T = ${fmt(Math.exp(-tau), 2)})`)),
    alternatives.length
      ? el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "top alternatives"), el("th", { class: "num" }, "calibrated"),
                                            el("th", { class: "num" }, "raw"))), el("tbody", {}, ...rows))
      : el("p", { class: "muted" }, "No alternatives for this token."));
}

function moveCursor(turn, i) {
  if (!turn.tokens.length) return;
  i = Math.max(0, Math.min(turn.tokens.length - 1, i));
  if (turn.cursor >= 0 && turn.tokens[turn.cursor]) turn.tokens[turn.cursor].span.classList.remove("current");
  turn.cursor = i;
  const span = turn.tokens[i].span;
  span.classList.add("current");
  span.scrollIntoView({ block: "nearest" });
  showToken(turn, i);
}

function onAnswerKey(turn, event) {
  const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 };
  if (event.key in moves) moveCursor(turn, turn.cursor + moves[event.key]);
  else if (event.key === "Home") moveCursor(turn, 0);
  else if (event.key === "End") moveCursor(turn, turn.tokens.length - 1);
  else return;
  event.preventDefault();
}

// --- the calibrator's record -----------------------------------------------------------------------------------------
function trainingLines(record) {
  // The fingerprint's headline: what kind of result it is and the data / task / method it names, as text.
  const lines = [];
  const seen = new Set();
  (function walk(value, path) {
    if (lines.length >= 8 || value === null || typeof value !== "object") return;
    for (const [key, v] of Object.entries(value)) {
      const name = path ? path + "." + key : key;
      if (/^(base_model|source|records|limit|split|task|tasks|name|method|head_type|loss_type|loss|epochs|lr|size|pool_size)$/i.test(key) &&
          (typeof v === "string" || typeof v === "number") && !seen.has(name)) {
        seen.add(name); lines.push(`${name}: ${v}`);
      } else if (typeof v === "object") walk(v, name);
    }
  })(record, "");
  return lines;
}

async function renderRecord() {
  const box = $("record");
  const info = state.info;
  const cal = info.calibrators.find((c) => c.id === state.calibrator);
  const parts = [el("p", {}, el("strong", {}, cal.label), " — ", cal.describe)];
  if (cal.folder) parts.push(el("p", { class: "muted" }, "folder: ", el("code", {}, cal.folder)));
  if (cal.training) {
    const lines = trainingLines(cal.training);
    parts.push(el("p", {}, `Trained as a "${cal.training.kind || "?"}" (fingerprint.json):`),
               el("ul", { class: "training" }, ...lines.map((l) => el("li", {}, el("code", {}, l)))),
               el("details", {}, el("summary", {}, "the whole training record"),
                  el("pre", {}, JSON.stringify(cal.training, null, 2))));
  } else {
    parts.push(el("p", { class: "muted", id: "no-training" }, state.unavailable.training
      ? `No training record here: ${state.unavailable.training}.`
      : cal.folder ? "Its folder has no training record (fingerprint.json): it was fitted by hand or downloaded."
        : "The model's own probabilities: nothing was trained."));
  }
  const t = cal.threshold;
  parts.push(el("p", {}, !t ? "No certified threshold (threshold.json) is loaded."
    : t.threshold === null || t.threshold === undefined
      ? `Certified threshold: none could be certified (target risk ${pct(first(t, "target_risk", "alpha"), 0)}, ` +
        `delta ${fmt(t.delta, 2)}, ${t.n} answers): it abstains on every answer.`
      : `Certified threshold: answer when the confidence is at least ${fmt(t.threshold)} (target risk ` +
        `${pct(first(t, "target_risk", "alpha"), 0)}, delta ${fmt(t.delta, 2)}, checked on ${t.n} answers, ` +
        `coverage ${pct(t.coverage)}).`));
  const evaluation = info.evaluation;
  const about = parts.splice(0); // left: what the calibrator is; right (parts from here on): its evaluation
  const show = () => box.replaceChildren(el("div", { class: "record-grid" }, el("div", {}, ...about), el("div", {}, ...parts)));
  if (state.unavailable.evaluation) {
    parts.push(el("h2", {}, "Evaluation"), el("p", { class: "muted", id: "no-evaluation" }, `Not on this server: ${state.unavailable.evaluation}.`));
    show();
    return;
  }
  if (!evaluation) {
    parts.push(el("h2", {}, "Evaluation"),
               el("p", {}, "No saved evaluation is loaded. Make one and show it here:"), el("pre", {}, cal.make_evaluation));
    show();
    return;
  }
  const method = cal.evaluation_method;
  parts.push(el("h2", {}, "Evaluation"));
  if (!method) {
    parts.push(el("p", {}, "The saved evaluation (", el("code", {}, evaluation.folder), ") does not include this " +
      "calibrator (methods are matched by their digest, not their name). Make one:"), el("pre", {}, cal.make_evaluation));
  } else {
    const rows = evaluation.tasks.filter((t) => t.metrics[method]).map((t) => {
      const m = t.metrics[method], ci = m.ece_ci;
      return el("tr", {}, el("td", {}, t.label), el("td", { class: "num" }, fmt(m.ece)),
        el("td", { class: "num" }, ci ? `[${fmt(ci[0])}, ${fmt(ci[1])}]` : "not bootstrapped"),
        el("td", { class: "num" }, fmt(m.accuracy)), el("td", { class: "num" }, m.n === undefined ? "–" : String(m.n)));
    });
    parts.push(el("p", { class: "muted" }, `As method "${method}" of `, el("code", {}, evaluation.folder),
                  ". ECE: expected calibration error (lower is better), with its 95% bootstrap interval."),
               el("table", { id: "eval-table" }, el("thead", {}, el("tr", {}, el("th", {}, "task"), el("th", { class: "num" }, "ECE"),
                 el("th", { class: "num" }, "95% interval"), el("th", { class: "num" }, "accuracy"), el("th", { class: "num" }, "n"))),
                 el("tbody", {}, ...rows)));
  }
  const taskSelect = el("select", { id: "diagram-task" }, ...evaluation.tasks.map((t) => el("option", { value: t.task }, t.label)));
  const methodSelect = el("select", { id: "diagram-method" }, ...evaluation.methods.map((m) => el("option", { value: m }, m)));
  if (method) methodSelect.value = method;
  const img = el("img", { class: "diagram", id: "diagram", alt: "" });
  const caption = el("p", { class: "muted" });
  const showDiagram = async () => {
    const task = taskSelect.value, m = methodSelect.value;
    img.alt = `reliability diagram of ${m} on ${task}`;
    delete img.dataset.shown;
    caption.textContent = "drawing…";
    try {
      const url = `/v1/playground/reliability.png?task=${encodeURIComponent(task)}&method=${encodeURIComponent(m)}`;
      const blob = await (await api(url)).blob();
      if (img.src) URL.revokeObjectURL(img.src);
      img.onload = () => { img.dataset.shown = `${task}/${m}`; };
      img.src = URL.createObjectURL(blob);
      caption.textContent = `Reliability diagram of ${m} on ${task}: bars are the accuracy per confidence bin, ` +
        "the diagonal is perfect calibration, red is the gap.";
    } catch (err) {
      img.removeAttribute("src");
      caption.textContent = err instanceof Unauthorized ? "" : "no diagram: " + err.message;
    }
  };
  taskSelect.addEventListener("change", showDiagram);
  methodSelect.addEventListener("change", showDiagram);
  parts.push(el("div", { class: "pickers" },
    el("label", {}, "task ", taskSelect), el("label", {}, "method ", methodSelect)), img, caption);
  show();
  showDiagram();
}

// --- wiring --------------------------------------------------------------------------------------------------------
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  load();
});
$("prompt-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("prompt-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = []; state.turns = [];
  $("transcript").replaceChildren();
  renderVerdict();
  $("token-detail").replaceChildren(el("p", { class: "muted" }, "Hover over a token, or focus the answer and move with ← →."));
});
for (const radio of document.querySelectorAll("input[name=shade]")) {
  radio.addEventListener("change", () => { state.shade = radio.value; repaint(); });
}
$("calibrator").addEventListener("change", async (event) => {
  state.calibrator = event.target.value;
  renderRecord();
  setStatus(`rescoring under ${state.calibrator}…`);
  document.body.dataset.rescoring = "true";
  try {
    for (const turn of state.turns) await rescoreTurn(turn, state.calibrator);
    setStatus(`shown under ${state.calibrator} (same tokens, rescored).`);
  } catch (err) {
    if (!(err instanceof Unauthorized)) setStatus("error: " + err.message, true);
  } finally {
    document.body.dataset.rescoring = "false";
  }
  repaint();
});
load();
