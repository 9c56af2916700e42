// skylift view: the run's recorded rollouts, filtered in the page. Plain JavaScript, no network:
// data/index.js calls skyliftView.index(...), each data/<record>.js calls skyliftView.add(...).
"use strict";

const skyliftView = (() => {
  const state = { index: null, records: {}, tab: "train", current: { train: null, eval: null } };
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "style") node.style.cssText = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  const fmt = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

  // ------------------------------------------------------------------ the list of records
  function index(data) {
    state.index = data;
    $("run-name").textContent = data.run;
    for (const tab of document.querySelectorAll(".tab")) {
      tab.addEventListener("click", () => showTab(tab.dataset.tab));
    }
    for (const input of document.querySelectorAll("#filters input, #filters select, #f-scale")) {
      input.addEventListener("input", render);
    }
    showTab(data.train.length || !data.eval.length ? "train" : "eval");
  }

  function showTab(tab) {
    state.tab = tab;
    for (const button of document.querySelectorAll(".tab")) {
      button.classList.toggle("active", button.dataset.tab === tab);
    }
    document.body.dataset.tab = tab;
    const times = tab === "times";
    $("times").hidden = !times;
    $("samples").hidden = times;
    $("filters").hidden = times;
    $("records").hidden = times;
    if (times) {
      drawTimes();
      return;
    }
    listRecords();
    const entries = state.index[tab];
    const chosen = state.current[tab] || (entries.length ? entries[entries.length - 1].name : null);
    if (chosen) open(chosen);
    else render();
  }

  function listRecords() {
    const aside = $("records");
    aside.replaceChildren();
    const entries = state.index[state.tab];
    if (!entries.length) {
      aside.append(el("p", { class: "empty" }, state.tab === "train" ? "no training step recorded" : "no evaluation recorded"));
      return;
    }
    for (const entry of entries) {
      const figure = state.tab === "eval"
        ? `acc ${fmt(entry.accuracy, 2)} · pass@${entry.k} ${fmt(entry.pass_at_k, 2)}`
        : `reward ${fmt(entry.reward_mean, 2)}`;
      const button = el("button", { class: "record", "data-name": entry.name },
        el("b", {}, state.tab === "eval" ? `eval after step ${entry.step}` : `step ${entry.step}`),
        el("span", {}, `${entry.groups} prompts · ${entry.samples} samples`),
        el("span", {}, figure));
      button.addEventListener("click", () => open(entry.name));
      aside.append(button);
    }
  }

  function open(name) {
    state.current[state.tab] = name;
    for (const button of document.querySelectorAll(".record")) {
      button.classList.toggle("active", button.dataset.name === name);
    }
    if (state.records[name]) {
      render();
      return;
    }
    $("samples").replaceChildren(el("p", { class: "empty" }, "loading…"));
    const script = el("script", { src: `data/${name}.js` });
    script.addEventListener("error", () => {
      $("samples").replaceChildren(el("p", { class: "empty" }, `data/${name}.js could not be read`));
    });
    document.body.append(script);
  }

  function add(name, record) {
    state.records[name] = record;
    if (state.current[state.tab] === name) render();
  }

  // ------------------------------------------------------------------ filters
  function number(id) {
    const text = $(id).value.trim();
    return text === "" ? null : Number(text);
  }

  function filters() {
    return {
      rewardMin: number("f-reward-min"), rewardMax: number("f-reward-max"),
      lenMin: number("f-len-min"), lenMax: number("f-len-max"),
      finish: $("f-finish").value, diff: number("f-diff"), correct: $("f-correct").value,
    };
  }

  function passes(sample, f, kind) {
    if (f.rewardMin !== null && sample.reward < f.rewardMin) return false;
    if (f.rewardMax !== null && sample.reward > f.rewardMax) return false;
    if (f.lenMin !== null && sample.length < f.lenMin) return false;
    if (f.lenMax !== null && sample.length > f.lenMax) return false;
    if (f.finish && sample.stop_reason !== f.finish) return false;
    if (kind === "train" && f.diff !== null && !((sample.max_abs_diff || 0) >= f.diff)) return false;
    if (kind === "eval" && f.correct && (f.correct === "correct") !== Boolean(sample.correct)) return false;
    return true;
  }

  function finishOptions(record) {
    const select = $("f-finish");
    const chosen = select.value;
    const reasons = new Set();
    for (const group of record.groups) for (const s of group.samples) reasons.add(s.stop_reason);
    select.replaceChildren(el("option", { value: "" }, "any"),
      ...[...reasons].sort().map((r) => el("option", { value: r }, r)));
    select.value = reasons.has(chosen) ? chosen : "";
  }

  // ------------------------------------------------------------------ samples
  function render() {
    const box = $("samples");
    const name = state.current[state.tab];
    const record = name ? state.records[name] : null;
    if (!record) {
      if (!name) box.replaceChildren(el("p", { class: "empty" }, "nothing recorded here"));
      $("f-count").textContent = "";
      return;
    }
    finishOptions(record);
    const f = filters();
    const scale = Math.max(Number($("f-scale").value) || 0.05, 1e-6);
    let shown = 0;
    let total = 0;
    const groups = [];
    for (const group of record.groups) {
      total += group.samples.length;
      const kept = group.samples.map((s, i) => [s, i]).filter(([s]) => passes(s, f, record.kind));
      shown += kept.length;
      if (kept.length) groups.push(renderGroup(group, kept, record.kind, scale));
    }
    $("f-count").textContent = `${shown} of ${total} samples`;
    box.replaceChildren(...groups);
    if (!groups.length) box.append(el("p", { class: "empty" }, "no sample passes the filters"));
  }

  function renderGroup(group, kept, kind, scale) {
    const rewards = group.samples.map((s) => s.reward);
    const mean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
    const head = el("div", { class: "group-head" },
      el("b", {}, `prompt ${group.uid}`),
      group.data_source ? el("span", { class: "badge" }, group.data_source) : null,
      group.env_class ? el("span", { class: "badge" }, group.env_class) : null,
      el("span", { class: "badge" }, `mean reward ${fmt(mean, 2)}`),
      kind === "eval" ? passBadge(group) : null);
    const prompt = el("div", { class: "prompt" });
    if (group.messages) {
      for (const m of group.messages) prompt.append(message(m.role, m.content, m.role === "system"));
    }
    const rendered = el("details", { class: "rendered" }, el("summary", {}, "prompt as the model saw it"),
      el("pre", {}, group.prompt_text));
    prompt.append(rendered);
    const samples = kept.map(([s, i]) => renderSample(s, i, kind, scale));
    return el("article", { class: "group" }, head, prompt, ...samples);
  }

  function passBadge(group) {
    const right = group.samples.some((s) => s.correct);
    return el("span", { class: `badge ${right ? "good" : "bad"}` }, `pass@${group.samples.length} ${right ? "yes" : "no"}`);
  }

  function message(role, content, folded) {
    const body = el("pre", {}, typeof content === "string" ? content : JSON.stringify(content, null, 1));
    if (folded) return el("details", { class: `msg ${role}` }, el("summary", {}, role), body);
    return el("div", { class: `msg ${role}` }, el("div", { class: "role" }, role), body);
  }

  function renderSample(s, i, kind, scale) {
    const badges = [
      el("b", {}, `sample ${i}`),
      el("span", { class: `badge ${s.reward > 0 ? "good" : "bad"}` }, `reward ${fmt(s.reward, 3)}`),
      s.advantage !== null && s.advantage !== undefined ? el("span", { class: "badge" }, `advantage ${fmt(s.advantage, 3)}`) : null,
      el("span", { class: `badge ${s.stop_reason === "stop" ? "" : "warn"}` }, `finish ${s.stop_reason}`),
      el("span", { class: "badge" }, `${s.length} tokens`),
      s.num_turns > 1 ? el("span", { class: "badge" }, `${s.num_turns} turns`) : null,
      kind === "eval" ? el("span", { class: `badge ${s.correct ? "good" : "bad"}` }, s.correct ? "correct" : "wrong") : null,
      s.max_abs_diff !== null && s.max_abs_diff !== undefined
        ? el("span", { class: "badge" }, `|Δlogprob| mean ${s.mean_abs_diff.toExponential(1)} max ${s.max_abs_diff.toExponential(1)}`) : null,
    ];
    if (kind === "train" && (s.max_abs_diff === null || s.max_abs_diff === undefined)) {
      badges.push(el("span", { class: "badge" }, "no trainer logprobs this step"));
    }
    for (const [key, value] of Object.entries(s.metrics || {})) badges.push(el("span", { class: "badge" }, `${key} ${fmt(value, 2)}`));
    const turns = s.segments.map((seg) => segment(seg, scale));
    return el("div", { class: "sample", "data-reward": s.reward }, el("div", { class: "sample-head" }, ...badges), ...turns);
  }

  function segment(seg, scale) {
    if (seg.role !== "assistant") {
      return el("div", { class: `msg ${seg.role}` }, el("div", { class: "role" }, seg.role === "tool" ? "tool result" : "observation"),
        el("pre", {}, seg.text.replace(/^\n+|\n+$/g, "")));
    }
    const body = el("pre", { class: "tokens" });
    if (seg.tokens) {
      seg.tokens.forEach((text, j) => {
        const d = seg.diff ? seg.diff[j] : null;
        const span = el("span", { class: "tok" }, text);
        if (d !== null) {
          span.style.background = colour(d, scale);
          span.title = `trainer − engine logprob: ${d.toExponential(2)}`;
          span.dataset.diff = d;
        }
        body.append(span);
      });
    } else {
      body.append(seg.text);
    }
    const label = seg.tool_call ? "assistant · tool call" : "assistant";
    return el("div", { class: `msg assistant${seg.tool_call ? " tool-call" : ""}` }, el("div", { class: "role" }, label), body);
  }

  function colour(d, scale) {
    const t = Math.min(Math.abs(d) / scale, 1);
    const [r, g, b] = d >= 0 ? [239, 68, 68] : [59, 130, 246];
    const mix = (c) => Math.round(255 + (c - 255) * t * 0.75); // the text stays readable
    return `rgb(${mix(r)}, ${mix(g)}, ${mix(b)})`;
  }

  // ------------------------------------------------------------------ step times
  const PARTS = [["generate", "#2563eb"], ["wait", "#93c5fd"], ["experience", "#f59e0b"], ["train", "#16a34a"],
    ["sync", "#9333ea"], ["eval", "#64748b"], ["records", "#dc2626"]];

  function drawTimes() {
    const box = $("times");
    const rows = state.index.timings;
    if (!rows.length) {
      box.replaceChildren(el("p", { class: "empty" }, "no step times in metrics.jsonl"));
      return;
    }
    const width = 900, height = 330, left = 50, bottom = 40, top = 10;
    const most = Math.max(...rows.map((r) => Math.max(r.step_s, PARTS.reduce((a, [p]) => a + r[p], 0))));
    const y = (s) => top + (height - top - bottom) * (1 - s / most);
    const bar = Math.min((width - left - 10) / rows.length, 48);
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("class", "chart");
    const put = (tag, attrs, text) => {
      const node = document.createElementNS(ns, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
      return node;
    };
    for (let i = 0; i <= 4; i++) {
      const s = (most * i) / 4;
      put("line", { x1: left, x2: width - 10, y1: y(s), y2: y(s), class: "grid" });
      put("text", { x: left - 6, y: y(s) + 4, "text-anchor": "end" }, `${s.toFixed(1)}s`);
    }
    rows.forEach((r, i) => {
      let base = 0;
      const x = left + i * bar + bar * 0.1;
      for (const [part, colourOf] of PARTS) {
        if (!r[part]) continue;
        const rect = put("rect", { x, width: bar * 0.8, y: y(base + r[part]), height: y(base) - y(base + r[part]), fill: colourOf });
        const title = document.createElementNS(ns, "title");
        title.textContent = `step ${r.step} ${part}: ${r[part].toFixed(2)} s`;
        rect.append(title);
        base += r[part];
      }
      put("line", { x1: x - bar * 0.05, x2: x + bar * 0.85, y1: y(r.step_s), y2: y(r.step_s), class: "total" });
      if (rows.length <= 40 || i % Math.ceil(rows.length / 40) === 0) {
        put("text", { x: x + bar * 0.4, y: height - bottom + 14, "text-anchor": "middle" }, r.step);
      }
    });
    put("text", { x: left, y: height - 2 }, "training step");
    const legend = el("div", { class: "chart-legend" }, ...PARTS.map(([p, c]) => el("span", {}, el("i", { style: `background:${c}` }), p)),
      el("span", {}, el("i", { class: "total-key" }), "whole step"));
    const note = el("p", { class: "note" }, "Seconds per training step from metrics.jsonl. With one-step-off or fully async ",
      "training, generation overlaps training, so the parts can add up to more than the step.");
    box.replaceChildren(el("h2", {}, "Step times"), legend, svg, note);
  }

  return { index, add };
})();
window.skyliftView = skyliftView;
