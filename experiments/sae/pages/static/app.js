// Feature pages of an SAE run (experiments/sae/pages/write.py writes the data). Data files are scripts that call
// FEATURES.index / FEATURES.chunk, so the pages work from disk; text is only ever set with textContent.
"use strict";
const FEATURES = (() => {
  let index = null;
  const chunks = {};
  const waiting = {};
  const state = { sort: "density", desc: true, page: 0, minDensity: "", token: "" };
  const PAGE = 100;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "style") node.style.cssText = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
    }
    return node;
  }

  function fmt(value, digits = 4) {
    if (value === null || value === undefined) return "-";
    if (value === 0) return "0";
    return Math.abs(value) < 1e-3 ? value.toExponential(2) : Number(value.toPrecision(digits)).toString();
  }

  const VISIBLE = { "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d" };
  const SHOWN = { ...VISIBLE, " ": "\u2423" };
  function tokenText(id) {
    const text = index.vocab ? index.vocab[id] : "#" + id + " ";
    return text === undefined ? "#" + id : text;
  }
  // alone (a table cell, a firing token) a blank token is drawn: a space as \u2423, an empty one as \u2205; in a
  // context's running text only line breaks and tabs are
  function token(id, strength, alone = strength !== undefined) {
    const raw = tokenText(id);
    const blank = /^\s*$/.test(raw);
    const drawn = raw === "" ? "\u2205" : [...raw].map((c) => SHOWN[c] || c).join("");
    const shown = alone && blank ? drawn : VISIBLE[raw] || raw;
    const span = el("span", { class: "tok" + (shown !== raw ? " ws" : "") }, shown);
    if (strength !== undefined) {
      span.classList.add("fire");
      span.style.background = `rgba(255, 140, 0, ${Math.max(0.15, Math.min(1, strength)).toFixed(2)})`;
    }
    return span;
  }
  function tokens(ids) {  // a latent's top tokens; one that never fired here has none, and says so
    if (!ids.length) return el("span", { class: "muted" }, "never fired");
    return el("span", {}, ...ids.map((id) => token(id, undefined, true)));
  }

  function context(item, peak) {
    const line = el("div", { class: "ctx" }, el("span", { class: "muted" }, fmt(item.value, 3).padStart(7) + "  "));
    if (item.ids) {
      item.ids.forEach((id, i) => line.append(token(id, i === item.at ? item.value / (peak || 1) : undefined)));
    } else {
      line.append("row " + item.row);
    }
    return line;
  }

  // a histogram: its bars, and a count axis (the tallest bar's count, 0) saying what they count
  function bars(counts, title, counted) {
    const top = Math.max(1, ...counts);
    return el("div", { class: "hist", title },
      el("div", { class: "axis" }, el("span", {}, top.toLocaleString()), el("span", {}, counted), el("span", {}, "0")),
      el("div", { class: "bars" },
        ...counts.map((c) => el("div", { style: `height:${(60 * c) / top}px`, title: String(c) }))));
  }

  function header() {
    const m = index.metrics || {};
    const splits = Object.entries(index.splits || {}).map(([k, v]) => `${k}: ${v}`).join(", ");
    return el("div", {},
      el("h1", {}, index.title || "SAE"),
      el("div", { class: "facts" },
        el("span", {}, "FVE " + fmt(m.fve)), el("span", {}, "L0 " + fmt(m.l0)),
        el("span", {}, "dead on the validation split " + fmt(m.dead_fraction)),
        el("span", {}, `${index.n_latents} latents, ${index.never_fired} dead on these rows`),
        el("span", {}, `${index.rows} rows (${index.texts ? "windows" : "rows"}: ${splits}) in ${index.seconds} s`)));
  }

  function rows() {
    const keys = [...Array(index.n_latents).keys()];
    const min = parseFloat(state.minDensity);
    let kept = isNaN(min) ? keys : keys.filter((i) => index.density[i] >= min);
    if (state.token) {
      kept = kept.filter((i) => index.top_tokens[i].some((t) => tokenText(t).includes(state.token)));
    }
    const column = state.sort === "latent" ? null : index[state.sort];
    kept.sort((a, b) => {
      const d = column ? column[a] - column[b] : a - b;
      return state.desc ? -d : d;
    });
    return kept;
  }

  function showIndex() {
    const app = document.getElementById("app");
    const kept = rows();
    const pages = Math.max(1, Math.ceil(kept.length / PAGE));
    state.page = Math.min(state.page, pages - 1);
    const columns = [["latent", "latent"], ["density", "density"], ["mean", "mean act"], ["max", "max act"]];
    if (index.truth) columns.push(["truth", "true feature cos"]);
    const head = el("tr", {}, ...columns.map(([key, label]) => el("th", {
      onclick: () => { state.desc = state.sort === key ? !state.desc : true; state.sort = key; showIndex(); },
    }, label + (state.sort === key ? (state.desc ? " \u25bc" : " \u25b2") : ""))),
    index.texts ? el("th", { class: "text" }, "top tokens") : null);
    const body = kept.slice(state.page * PAGE, (state.page + 1) * PAGE).map((i) => el("tr", { class: "latent-row" },
      el("td", {}, el("a", { href: "#latent=" + i }, String(i))),
      el("td", {}, fmt(index.density[i], 3)), el("td", {}, fmt(index.mean[i], 3)), el("td", {}, fmt(index.max[i], 3)),
      index.truth ? el("td", {}, fmt(index.truth[i], 3)) : null,
      index.texts ? el("td", { class: "text ctx" }, tokens(index.top_tokens[i])) : null));
    const minInput = el("input", { type: "text", size: 8, value: state.minDensity, placeholder: "e.g. 1e-4" });
    minInput.addEventListener("change", () => { state.minDensity = minInput.value; state.page = 0; showIndex(); });
    const tokenInput = el("input", { type: "text", size: 8, value: state.token });
    tokenInput.addEventListener("change", () => { state.token = tokenInput.value; state.page = 0; showIndex(); });
    const step = (d) => () => { state.page = Math.min(pages - 1, Math.max(0, state.page + d)); showIndex(); };
    const h = index.log_density_hist;
    app.replaceChildren(header(),
      el("h2", {}, "log10 firing density of the latents that fired"),
      bars(h.counts, `from 1e${h.low} to 1e${h.high}`, "latents"),
      el("div", { class: "muted" }, `1e${h.low} \u2192 1e${h.high}`),
      el("div", { class: "controls" }, "min density ", minInput, index.texts ? "top token contains " : null,
        index.texts ? tokenInput : null,
        el("button", { onclick: step(-1) }, "\u2190"), ` page ${state.page + 1} of ${pages} (${kept.length} latents) `,
        el("button", { onclick: step(1) }, "\u2192")),
      el("table", { id: "latents" }, el("thead", {}, head), el("tbody", {}, ...body)));
  }

  function load(number, then) {
    if (chunks[number]) return then();
    (waiting[number] = waiting[number] || []).push(then);
    if (waiting[number].length > 1) return;
    const script = el("script", { src: `data/latents-${String(number).padStart(4, "0")}.js` });
    script.onerror = () => { document.getElementById("app").textContent = "cannot load " + script.src; };
    document.body.append(script);
  }

  function logitTable(title, pairs) {
    return el("div", {}, el("h3", {}, title), el("table", {}, el("tbody", {},
      ...pairs.map(([id, logit]) => el("tr", {}, el("td", { class: "text ctx" }, token(id, undefined, true)), el("td", {}, fmt(logit, 3)))))));
  }

  function showLatent(i) {
    const app = document.getElementById("app");
    if (!(i >= 0 && i < index.n_latents)) { app.textContent = "no latent " + i; return; }
    load(Math.floor(i / index.chunk), () => {
      const latent = chunks[Math.floor(i / index.chunk)][i];
      const peak = index.max[i];
      const h = index.hist;
      const first = latent.hist.findIndex((c) => c > 0);
      const last = latent.hist.length - 1 - [...latent.hist].reverse().findIndex((c) => c > 0);
      const parts = [header(), el("p", {}, el("a", { href: "#" }, "\u2190 all latents")),
        el("h2", { id: "latent-title" }, "latent " + i),
        el("div", { class: "facts" }, el("span", {}, "density " + fmt(index.density[i], 3)),
          el("span", {}, "mean act " + fmt(index.mean[i], 3)), el("span", {}, "max act " + fmt(peak, 3)),
          latent.truth ? el("span", {}, `best true feature ${latent.truth[0]} (cos ${fmt(latent.truth[1], 3)})`) : null)];
      if (first >= 0) {
        const low = (b) => fmt(Math.pow(10, h.low + b / h.per_decade), 2);
        parts.push(el("h3", {}, "activations (log10 bins)"), bars(latent.hist.slice(first, last + 1), "", "rows"),
          el("div", { class: "muted" }, `${low(first)} \u2192 ${low(last + 1)}`));
      }
      parts.push(el("h3", {}, index.texts ? "strongest contexts" : "strongest rows"),
        el("div", { id: "contexts" }, ...latent.contexts.map((c) => context(c, peak))));
      for (const interval of latent.intervals) {
        const fifth = `${(100 * interval.quantile) / index.quantiles}-${(100 * (interval.quantile + 1)) / index.quantiles}%`;
        parts.push(el("h3", { class: "quantile" }, `examples from the ${fifth} quantile of its activations (${interval.low} to ${interval.high})`),
          ...interval.items.map((c) => context(c, peak)));
      }
      if (latent.note) parts.push(el("p", { class: "muted note" }, latent.note));
      const cols = el("div", { class: "cols" });
      if (latent.promoted) {
        const note = index.lens_tied ? " (unembedding tied to the embedding)" : "";
        cols.append(logitTable("promotes" + note, latent.promoted), logitTable("suppresses", latent.suppressed));
      }
      cols.append(el("div", {}, el("h3", {}, "nearest latents (decoder cosine)"), el("table", {}, el("tbody", {},
        ...latent.near.map((j, k) => el("tr", {}, el("td", {}, el("a", { href: "#latent=" + j }, String(j))),
          el("td", {}, fmt(latent.near_cos[k], 3))))))));
      parts.push(cols);
      app.replaceChildren(...parts);
    });
  }

  function route() {
    if (!index) return;
    const match = /^#latent=(\d+)$/.exec(location.hash);
    if (match) showLatent(parseInt(match[1], 10));
    else showIndex();
  }
  window.addEventListener("hashchange", route);

  return {
    index(data) { index = data; route(); },
    chunk(data) {
      const number = Math.floor(data.start / index.chunk);
      chunks[number] = data.latents;
      for (const then of waiting[number] || []) then();
      delete waiting[number];
    },
  };
})();
