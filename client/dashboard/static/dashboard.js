// The psyswarm dashboard: polls /api/view once a second and writes it into the page.
// Every value is written with textContent (never innerHTML): names and repository strings come from peers.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function $(id) { return document.getElementById(id); }

function setText(id, text) { $(id).textContent = text; }

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (className) td.className = className;
}

function fillTable(id, rows, columns) {
  const body = $(id).tBodies[0];
  body.replaceChildren();
  for (const [index, item] of rows.entries()) {
    const row = body.insertRow();
    for (const [value, className] of columns(item, index)) cell(row, value, className);
  }
}

function seconds(n) {
  if (n === null || n === undefined) return "–";
  return n >= 60 ? `${Math.floor(n / 60)}m ${n % 60}s` : `${n}s`;
}

function showProgress(p) {
  setText("run-id", p.run_id);
  setText("phase", p.phase + (p.pause_requested ? " (pause requested)" : ""));
  setText("time-left", p.phase_left === null ? `– (${seconds(p.phase_elapsed)} in)` : seconds(p.phase_left));
  setText("epoch", p.epoch);
  setText("round", p.round === null ? "–" : `${p.round}/${p.rounds_per_epoch}`);
  setText("step", `${p.step}/${p.total_steps}`);
}

function showOccupancy(o) {
  fillTable("stages", o.stages, s => [[s.name], [s.members], [s.active], [s.sync1], [s.sync2]]);
  setText("clients", `trainers ${o.trainers} · pending ${o.pending} · min ${o.min_clients} · max ${o.max_clients}`);
}

function svgElement(name, attributes, text) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, String(value));
  if (text !== undefined) element.textContent = text;
  return element;
}

function niceTicks(bottom, top, count) {
  // Round-numbered ticks (1, 2 or 5 times a power of ten) covering [bottom, top].
  const raw = (top - bottom) / count || Math.abs(top) / 10 || 1;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * power).find(s => s >= raw);
  const ticks = [];
  for (let t = Math.floor(bottom / step) * step; t <= top + step / 2; t += step) ticks.push(Number(t.toFixed(10)));
  if (ticks.length === 1) ticks.push(ticks[0] + step);
  return {ticks, digits: Math.max(0, -Math.floor(Math.log10(step)))};
}

function roundName(p) {
  return `e${p.epoch} r${p.round}`;
}

function showLoss(points, tokensPerSecond, dht) {
  const chart = $("loss-chart");
  chart.replaceChildren();
  const last = points[points.length - 1];
  const none = dht ? "no loss committed yet" : "the loss is read from the run's DHT: start with --initial-peer";
  setText("last-loss", last ? `last loss ${last.loss.toFixed(4)} (epoch ${last.epoch}, round ${last.round})` : none);
  setText("tokens-per-s", tokensPerSecond === null ? "tokens/s –" : `${Math.round(tokensPerSecond)} tokens/s`);
  if (points.length === 0) return;
  const losses = points.map(p => p.loss);
  const {ticks, digits} = niceTicks(Math.min(...losses), Math.max(...losses), 4);
  const bottom = ticks[0], top = ticks[ticks.length - 1];
  const left = 44, right = 395, up = 8, down = 132;
  const x = i => left + (points.length === 1 ? 0 : (i * (right - left)) / (points.length - 1));
  const y = loss => down - ((loss - bottom) * (down - up)) / (top - bottom);
  for (const tick of ticks) {
    chart.append(svgElement("line", {class: "grid", x1: left, y1: y(tick), x2: right, y2: y(tick)}),
                 svgElement("text", {class: "tick", x: left - 4, y: y(tick) + 3}, tick.toFixed(digits)));
  }
  points.forEach((p, i) => {  // each epoch's first round read
    if (i > 0 && p.epoch !== points[i - 1].epoch) {
      chart.append(svgElement("line", {class: "epoch", x1: x(i), y1: up, x2: x(i), y2: down}));
    }
  });
  chart.append(svgElement("line", {x1: left, y1: down, x2: right, y2: down}),
               svgElement("line", {x1: left, y1: up, x2: left, y2: down}),
               svgElement("text", {x: left, y: 146}, roundName(points[0])),
               svgElement("text", {class: "end", x: right, y: 146}, roundName(last)),
               svgElement("text", {class: "middle", x: (left + right) / 2, y: 157}, `${points.length} rounds`),
               svgElement("polyline", {points: points.map((p, i) => `${x(i)},${y(p.loss)}`).join(" ")}));
}

function showWitnesses(w) {
  setText("proofs", w.quorum === null ? "no round in progress"
                                      : `proofs received: ${w.received} (quorum ${w.quorum})`);
  const list = $("witnesses");
  list.replaceChildren();
  for (const witness of w.elected) {
    const item = document.createElement("li");
    item.textContent = `${witness.proved ? "✓" : "…"} ${witness.key}`;
    item.className = witness.proved ? "proved" : "waiting";
    list.append(item);
  }
}

function showCheckpoint(c) {
  setText("checkpoint", c.text);
}

function showLeaderboard(rows, identities) {
  fillTable("leaderboard", rows, (r, i) => [[i + 1], [r.name, "name"], [r.keys], [r.presence],
                                       [r.compute], [r.total]]);
  setText("identities", identities ? "keys summed per contributor, as the run's auth service grants them"
                                   : "one row per key (no --auth-url: keys are not tied to contributors)");
}

function showProblems(problems) {
  setText("problems", Object.entries(problems || {}).map(([part, why]) => `${part}: ${why}`).join(" · "));
}

function show(view) {
  const error = $("error");
  error.hidden = !view.error;
  error.textContent = view.error || "";
  showProblems(view.problems);
  if (!view.progress) return;  // nothing received from the coordinator yet
  showProgress(view.progress);
  showOccupancy(view.occupancy);
  showLoss(view.loss, view.tokens_per_s, view.dht);
  showWitnesses(view.witnesses);
  showCheckpoint(view.checkpoint);
  showLeaderboard(view.leaderboard, view.identities);
}

async function poll() {
  try {
    const answer = await fetch("/api/view", {cache: "no-store"});
    show(await answer.json());
  } catch (exc) {
    show({error: `dashboard server unreachable: ${exc.message}`});
  }
  setTimeout(poll, 1000);
}

poll();
