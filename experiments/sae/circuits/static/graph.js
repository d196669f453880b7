// The attribution graph page (experiments/sae/circuits/page.py embeds the graph and its tokens' text): nodes laid out
// by layer (rows, embeddings at the bottom, logits at the top) and position (columns), edges coloured by sign and as
// wide as their weight, and a panel for the node under the pointer (a click keeps it, and #node=ID opens on it).
// Every string of the data is set with textContent or setAttribute, never parsed as markup.
"use strict";
(() => {
  const NS = "http://www.w3.org/2000/svg";
  const { graph, view } = JSON.parse(document.getElementById("graph-data").textContent);
  const nodes = graph.nodes || [];
  const edges = graph.edges || [];
  // the layout's sizes in pixels: features per line of a cell, the line's height, a column's least width
  const STEP = 26, PER_LINE = 6, LINE = 28, PAD = 12, COL_MIN = 42, LABELS = 92, TOP = 8, BOTTOM = 26, RIGHT = 12;
  const LOGIT_W = 50, BOX_H = 20, TOP_EDGES = 8;

  function make(ns, tag, attrs, children) {
    const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
    }
    return node;
  }
  const el = (tag, attrs, ...children) => make(null, tag, attrs, children);
  const svg = (tag, attrs, ...children) => make(NS, tag, attrs, children);

  function fmt(value, digits = 4) {
    if (value === null || value === undefined || Number.isNaN(value)) return "-";
    if (value === 0) return "0";
    return Math.abs(value) < 1e-3 ? value.toExponential(2) : Number(value.toPrecision(digits)).toString();
  }

  // the largest of f over a list (a graph kept at threshold 1 has too many edges for Math.max's arguments)
  const most = (list, f, least) => list.reduce((m, item) => Math.max(m, f(item)), least);
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const layers = graph.n_layers ?? 1 + most(nodes, (n) => n.layer ?? -1, -1);
  const positions = (graph.tokens || []).length || 1 + most(nodes, (n) => n.pos ?? 0, 0);
  const tokenText = (pos) => view.tokens[pos] ?? "#" + (graph.tokens || [])[pos];
  const logitText = (node) => view.logits[String(node.id)] ?? "#" + node.token;
  const rowOf = (node) => (node.kind === "token" ? 0 : node.kind === "logit" ? layers + 1 : node.layer + 1);

  function name(node) {  // a node in a few words: the panel's title, an edge's other end
    if (node.kind === "feature") return `L${node.layer} latent ${node.latent} @ ${node.pos} ${tokenText(node.pos)}`;
    if (node.kind === "error") return `error L${node.layer} @ ${node.pos} ${tokenText(node.pos)}`;
    if (node.kind === "token") return `token ${tokenText(node.pos)} @ ${node.pos}`;
    return `logit ${logitText(node)} (p ${fmt(node.probability, 3)})`;
  }

  // ---- layout: a cell per (row, position), its features (the most influential first) in lines of PER_LINE
  const cells = new Map();
  for (const node of nodes) {
    if (node.kind === "logit") continue;
    const key = rowOf(node) * positions + node.pos;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(node);
  }
  for (const cell of cells.values()) {
    cell.sort((a, b) => (a.kind === "error") - (b.kind === "error") || (b.influence || 0) - (a.influence || 0));
  }
  const cell = (row, pos) => cells.get(row * positions + pos) || [];
  const width = [];
  for (let pos = 0; pos < positions; pos++) {
    let most = 0;
    for (let row = 1; row <= layers; row++) most = Math.max(most, cell(row, pos).length);
    width.push(Math.max(COL_MIN, Math.min(most, PER_LINE) * STEP + 12));
  }
  const left = [8];  // the rows' names are a sticky column of their own
  width.forEach((w) => left.push(left[left.length - 1] + w));
  const gridW = left[positions] - left[0];
  const logits = nodes.filter((n) => n.kind === "logit").sort((a, b) => (b.probability || 0) - (a.probability || 0));
  const logitsPerLine = Math.max(1, Math.floor(gridW / LOGIT_W));
  const lines = [1];  // per row
  for (let row = 1; row <= layers; row++) {
    let most = 1;
    for (let pos = 0; pos < positions; pos++) most = Math.max(most, Math.ceil(cell(row, pos).length / PER_LINE));
    lines.push(most);
  }
  lines.push(Math.max(1, Math.ceil(logits.length / logitsPerLine)));
  // rows stretched to the window's height (up to twice their own): edges between layers are easier to follow
  const room = document.getElementById("graph").clientHeight - TOP - BOTTOM - 16;
  const own = lines.reduce((sum, n) => sum + n * LINE + 2 * PAD, 0);
  const stretch = Math.min(2, Math.max(1, room / own));
  const height = lines.map((n) => (n * LINE + 2 * PAD) * stretch);
  const top = [];  // the logits' row first, from the top
  let y = TOP;
  for (let row = layers + 1; row >= 0; row--) {
    top[row] = y;
    y += height[row];
  }
  const totalW = left[0] + gridW + RIGHT;
  const totalH = y + BOTTOM;

  const at = new Map();  // id -> [x, y]
  function place(list, row, perLine, step, rightOf) {  // list's nodes in centred lines, or ending at `rightOf`
    const usedLines = Math.ceil(list.length / perLine);
    const offset = top[row] + (height[row] - usedLines * LINE) / 2 + LINE / 2;
    list.forEach((node, i) => {
      const line = Math.floor(i / perLine), k = i % perLine;
      const inLine = Math.min(perLine, list.length - line * perLine);
      const x = rightOf === undefined
        ? left[node.pos] + width[node.pos] / 2 + (k - (inLine - 1) / 2) * step
        : rightOf - (inLine - k - 0.5) * step;
      at.set(node.id, [x, offset + line * LINE]);
    });
  }
  for (const [key, list] of cells) place(list, Math.floor(key / positions), PER_LINE, STEP);
  place(logits, layers + 1, logitsPerLine, LOGIT_W, left[positions]);

  // ---- drawing
  const root = svg("svg", { width: totalW, height: totalH, viewBox: `0 0 ${totalW} ${totalH}`, id: "drawing" });
  const names = svg("svg", { width: LABELS, height: totalH, class: "labels" });
  const rowName = (row) => (row === 0 ? "embeddings" : row === layers + 1 ? "logits" : `layer ${row - 1}`);
  for (let row = 0; row <= layers + 1; row++) {
    if (row % 2 === 1) {
      for (const [into, w] of [[root, totalW], [names, LABELS]]) {
        into.append(svg("rect", { class: "band", x: 0, y: top[row], width: w, height: height[row] }));
      }
    }
    names.append(svg("text", { class: "axis", x: 8, y: top[row] + height[row] / 2 + 4 }, rowName(row)));
  }
  names.append(svg("text", { class: "col", x: 8, y: y + 16 }, "position"));
  for (let pos = 0; pos < positions; pos++) {
    const x = left[pos] + width[pos] / 2;
    root.append(svg("line", { x1: left[pos], x2: left[pos], y1: TOP, y2: y, stroke: "#eee" }));
    root.append(svg("text", { class: "col", x, y: y + 16, "text-anchor": "middle" }, String(pos)));
  }

  const strongest = most(edges, (e) => Math.abs(e.weight), 1e-30);
  const incoming = new Map(), outgoing = new Map();
  const edgeLayer = svg("g", { class: "edges" });
  const drawn = edges.filter((e) => at.has(e.source) && at.has(e.target));
  drawn.sort((a, b) => Math.abs(a.weight) - Math.abs(b.weight)); // the strongest on top
  for (const edge of drawn) {
    const [x1, y1] = at.get(edge.source), [x2, y2] = at.get(edge.target);
    // width by the square root of |weight|, opacity by |weight| itself: thousands of weak edges stay a haze
    const share = Math.abs(edge.weight) / strongest;
    edge.line = svg("line", {
      class: "edge", x1, y1, x2, y2,
      stroke: edge.weight >= 0 ? "#2f6fcf" : "#c8372d",
      "stroke-width": (0.4 + 3.6 * Math.sqrt(share)).toFixed(2),
      "stroke-opacity": (0.05 + 0.75 * share).toFixed(3),
    }, svg("title", {}, `${name(byId.get(edge.source))} \u2192 ${name(byId.get(edge.target))}: ${fmt(edge.weight)}`));
    edgeLayer.append(edge.line);
    for (const [map, id] of [[outgoing, edge.source], [incoming, edge.target]]) {
      if (!map.has(id)) map.set(id, []);
      map.get(id).push(edge);
    }
  }
  root.append(edgeLayer);

  const sized = nodes.filter((n) => n.kind === "feature" || n.kind === "error");
  const influence = most(sized, (n) => n.influence || 0, 1e-30);
  const radius = (node) => 3.5 + 8.5 * Math.sqrt(Math.max(0, node.influence || 0) / influence);
  function shape(node) {
    if (node.kind === "feature") return [svg("circle", { class: "shape", r: radius(node).toFixed(2) })];
    if (node.kind === "error") {
      const r = radius(node).toFixed(2);
      return [svg("rect", { class: "shape", x: -r, y: -r, width: 2 * r, height: 2 * r })];
    }
    const text = node.kind === "token" ? tokenText(node.pos) : logitText(node);
    const fits = Math.max(34, [...text].length * 6.7 + 12);
    const w = node.kind === "token" ? Math.min(width[node.pos] - 8, fits) : LOGIT_W - 6;
    const room = Math.max(1, Math.floor((w - 6) / 6.7));
    const shown = [...text].length > room ? [...text].slice(0, room - 1).join("") + "\u2026" : text;
    return [
      svg("rect", { class: "shape", x: -w / 2, y: -BOX_H / 2, width: w, height: BOX_H, rx: 3 }),
      svg("text", { "text-anchor": "middle", y: 4 }, shown),
    ];
  }
  const shapes = new Map();
  const nodeLayer = svg("g", { class: "nodes" });
  for (const node of nodes) {
    if (!at.has(node.id)) continue;
    const [x, y] = at.get(node.id);
    const g = svg("g", { class: `node ${node.kind}`, "data-id": node.id, transform: `translate(${x},${y})` },
      ...shape(node));
    g.addEventListener("mouseenter", () => picked === null && show(node));
    g.addEventListener("mouseleave", () => picked === null && show(null));
    g.addEventListener("click", (event) => { event.stopPropagation(); pick(picked === node.id ? null : node.id); });
    shapes.set(node.id, g);
    nodeLayer.append(g);
  }
  root.append(nodeLayer);
  root.addEventListener("click", () => pick(null));
  const scroller = document.getElementById("graph");
  scroller.append(el("div", { class: "canvas" }, names, root));
  scroller.scrollLeft = scroller.scrollWidth;  // the last position first: where the logits read the graph

  // ---- the panel
  const panel = document.getElementById("panel");
  let picked = null;
  function pick(id, remember = true) {  // remembered in the URL (#node=ID), so that a view can be shared
    picked = byId.has(id) ? id : null;
    for (const [key, g] of shapes) g.classList.toggle("picked", key === picked);
    show(picked === null ? null : byId.get(picked));
    if (picked !== null) reveal(...at.get(picked));
    const hash = picked === null ? "" : `#node=${picked}`;
    try {
      if (remember) history.replaceState(null, "", location.pathname + location.search + hash);
    } catch (error) {
      // a browser that keeps file:// URLs as they are: the panel is the same
    }
  }

  function reveal(x, y) {  // scrolled to the middle where it is out of sight (or under the rows' names)
    const wide = scroller.clientWidth - LABELS, high = scroller.clientHeight;
    if (x < scroller.scrollLeft + 16 || x > scroller.scrollLeft + wide - 16) scroller.scrollLeft = x - wide / 2;
    if (y < scroller.scrollTop + 16 || y > scroller.scrollTop + high - 16) scroller.scrollTop = y - high / 2;
  }

  function edgeTable(title, list, other) {
    if (!list.length) return [el("h3", {}, title), el("div", { class: "muted" }, "none kept")];
    const rows = [...list].sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight)).slice(0, TOP_EDGES);
    return [
      el("h3", {}, `${title} (${Math.min(list.length, TOP_EDGES)} of ${list.length})`),
      el("table", {}, ...rows.map((e) => el("tr", {},
        el("td", { class: `num ${e.weight >= 0 ? "pos" : "neg"}` }, fmt(e.weight, 3)),
        el("td", {}, el("button", { class: "to", type: "button", onclick: () => pick(e[other]) },
          name(byId.get(e[other]))))))),
    ];
  }

  function facts(node) {
    const rows = [["kind", node.kind]];
    if (node.layer !== undefined && node.kind !== "logit") rows.push(["layer", node.layer]);
    rows.push(["position", `${node.pos} (${tokenText(node.pos)})`]);
    if (node.kind === "feature") rows.push(["latent", node.latent], ["activation", fmt(node.activation)]);
    if (node.kind === "error") rows.push(["norm", fmt(node.norm)]);
    if (node.kind === "token") rows.push(["token", `${tokenText(node.pos)} (id ${node.token})`]);
    if (node.kind === "logit") {
      rows.push(["token", `${logitText(node)} (id ${node.token})`], ["probability", fmt(node.probability)]);
    }
    rows.push(["influence", fmt(node.influence)]);
    return table(rows);
  }

  function table(rows) {  // [key, value] pairs
    const row = ([k, v]) => el("tr", {}, el("td", { class: "key" }, k), el("td", {}, String(v)));
    return el("table", {}, ...rows.map(row));
  }

  function featureLink(node) {
    const page = view.pages[String(node.layer)];
    if (page) return el("p", {}, el("a", { href: `${page}#latent=${node.latent}`, class: "feature-page" },
      `feature page of latent ${node.latent} (layer ${node.layer})`));
    return el("p", { class: "muted" }, "no feature pages for this layer (python -m runner.features RUN writes them)");
  }

  function summary() {
    const kinds = {};
    for (const node of nodes) kinds[node.kind] = (kinds[node.kind] || 0) + 1;
    const settings = ["node_threshold", "edge_threshold", "max_logits", "logit_mass"].filter((k) => k in graph);
    return [
      el("h2", {}, "The graph"),
      el("p", { class: "muted" }, "Hover a node for its details; a click keeps them (a click elsewhere lets go)."),
      table([...Object.entries(kinds).map(([k, n]) => [k + "s", n]), ["edges", edges.length]]),
      settings.length ? el("h3", {}, "pruning") : null,
      table(settings.map((k) => [k, graph[k]])),
      el("h3", {}, "from"),
      el("div", { class: "mono" }, `model ${graph.model ?? "-"}`),
      ...(graph.coder || []).map((run) => el("div", { class: "mono" }, `coder ${run}`)),
    ];
  }

  function show(node) {
    root.classList.toggle("focus", node !== null);
    for (const g of root.querySelectorAll(".near")) g.classList.remove("near");
    if (node === null) {
      panel.replaceChildren(...summary().filter((part) => part !== null));
      return;
    }
    const ins = incoming.get(node.id) || [], outs = outgoing.get(node.id) || [];
    for (const e of ins.concat(outs)) {
      e.line.classList.add("near");
      for (const id of [e.source, e.target]) shapes.get(id)?.classList.add("near");
    }
    panel.replaceChildren(
      el("h2", {}, name(node)), facts(node), node.kind === "feature" ? featureLink(node) : null,
      ...edgeTable("strongest inputs", ins, "source"), ...edgeTable("strongest outputs", outs, "target"),
    );
  }

  // ---- the header
  // the prompt on one line, its line breaks and tabs drawn (graph.json holds it as it was)
  const prompt = graph.prompt ?? (graph.tokens || []).map((_, i) => tokenText(i)).join("");
  document.getElementById("prompt").textContent = prompt.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  document.title = `Attribution graph: ${String(graph.prompt ?? "").slice(0, 60)}`;
  const scores = graph.scores || {}, unpruned = graph.unpruned || {};
  const fact = (label, value) => el("span", {}, `${label} `, el("b", {}, value));
  document.getElementById("facts").replaceChildren(
    fact("replacement score", fmt(scores.replacement)),
    fact("completeness score", fmt(scores.completeness)),
    fact("kept", `${nodes.length} nodes, ${edges.length} edges`),
    fact("of", `${unpruned.nodes ?? "-"} nodes (${unpruned.features ?? "-"} features), ${unpruned.edges ?? "-"} edges`),
    fact("layers", String(layers)),
  );
  const icon = (shape) => svg("svg", { width: 22, height: 14, viewBox: "-11 -7 22 14" }, shape);
  const key = (shape, text) => el("span", {}, icon(shape), text);
  const stroke = (colour) => svg("line", { x1: -10, x2: 10, y1: 0, y2: 0, stroke: colour, "stroke-width": 3 });
  document.getElementById("legend").replaceChildren(
    key(svg("g", { class: "node feature" }, svg("circle", { class: "shape", r: 5 })), "feature (size: influence)"),
    key(svg("g", { class: "node error" }, svg("rect", { class: "shape", x: -5, y: -5, width: 10, height: 10 })),
      "error (what the coders miss)"),
    key(svg("g", { class: "node token" }, svg("rect", { class: "shape", x: -9, y: -6, width: 18, height: 12, rx: 2 })),
      "token / logit"),
    key(stroke("#2f6fcf"), "positive edge"),
    key(stroke("#c8372d"), "negative edge (width: |weight|)"),
  );

  const route = () => pick(Number((/^#node=(\d+)$/.exec(location.hash) || [])[1] ?? NaN), false);
  route();
  window.addEventListener("hashchange", route);
  document.body.dataset.drawn = String(shapes.size);  // what the browser test reads: the script ran to its end
})();
