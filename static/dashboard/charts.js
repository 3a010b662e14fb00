// Small SVG bar charts for the usage page. Data comes from <script type="application/json"> blocks
// written by Django's json_script: no inline scripts, no third-party library.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";

  function el(name, attrs, text) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function compact(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(n >= 1e10 ? 0 : 1).replace(/\.0$/, "") + "B";
    if (n >= 1e6) return (n / 1e6).toFixed(n >= 1e7 ? 0 : 1).replace(/\.0$/, "") + "M";
    if (n >= 1e3) return (n / 1e3).toFixed(n >= 1e4 ? 0 : 1).replace(/\.0$/, "") + "k";
    return String(n);
  }

  // A round axis maximum and step (1, 2 or 5 times a power of ten) giving about `count` ticks.
  function niceScale(max, count) {
    if (max <= 0) return { max: 1, step: 1 };
    var raw = max / count;
    var pow = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 5, 10].map(function (m) { return m * pow; }).find(function (s) { return s >= raw; });
    return { max: Math.ceil(max / step) * step, step: step };
  }

  function tooltip(row, label) {
    return label + "\nPrompt: " + row.prompt.toLocaleString() + "\nCompletion: " +
      row.completion.toLocaleString() + "\nRequests: " + row.requests.toLocaleString();
  }

  function emptyNote(svg, width, height) {
    svg.appendChild(el("text", { x: width / 2, y: height / 2, "text-anchor": "middle", "class": "empty-note" },
      "No usage in this period"));
  }

  function drawDaily(container, rows) {
    var width = 900, height = 240, left = 48, right = 8, top = 10, bottom = 28;
    var svg = el("svg", { viewBox: "0 0 " + width + " " + height, preserveAspectRatio: "xMidYMid meet" });
    var plotW = width - left - right, plotH = height - top - bottom;
    var peak = Math.max.apply(null, rows.map(function (r) { return r.prompt + r.completion; }).concat([0]));
    var scale = niceScale(peak, 4);
    for (var v = 0; v <= scale.max; v += scale.step) {
      var y = top + plotH - (v / scale.max) * plotH;
      svg.appendChild(el("line", { x1: left, x2: width - right, y1: y, y2: y, "class": v ? "grid-line" : "axis" }));
      svg.appendChild(el("text", { x: left - 6, y: y + 4, "text-anchor": "end", "class": "tick" }, compact(v)));
    }
    var slot = plotW / Math.max(rows.length, 1);
    var barW = Math.max(2, Math.min(28, slot * 0.7));
    var labelEvery = Math.ceil(rows.length / 10);
    rows.forEach(function (row, i) {
      var x = left + i * slot + (slot - barW) / 2;
      var hPrompt = (row.prompt / scale.max) * plotH;
      var hCompletion = (row.completion / scale.max) * plotH;
      var g = el("g", { "class": "bar", "data-day": row.day });
      g.appendChild(el("title", {}, tooltip(row, row.day)));
      g.appendChild(el("rect", { x: x, width: barW, y: top + plotH - hPrompt, height: hPrompt, "class": "bar-prompt" }));
      g.appendChild(el("rect", { x: x, width: barW, y: top + plotH - hPrompt - hCompletion, height: hCompletion,
        "class": "bar-completion" }));
      svg.appendChild(g);
      // Count from the last day, so today always has its label and no two labels collide.
      if ((rows.length - 1 - i) % labelEvery === 0) {
        var d = new Date(row.day + "T00:00:00Z");
        var text = d.toLocaleDateString(undefined, { month: "short", day: "numeric", timeZone: "UTC" });
        svg.appendChild(el("text", { x: x + barW / 2, y: height - 8, "text-anchor": "middle", "class": "tick" }, text));
      }
    });
    if (!peak) emptyNote(svg, width, height);
    container.appendChild(svg);
  }

  function drawModels(container, rows) {
    var rowH = 30, left = 170, right = 70, width = 900;
    var height = rows.length ? rows.length * rowH + 16 : 80;
    var svg = el("svg", { viewBox: "0 0 " + width + " " + height, preserveAspectRatio: "xMidYMid meet" });
    var plotW = width - left - right;
    var peak = Math.max.apply(null, rows.map(function (r) { return r.prompt + r.completion; }).concat([0]));
    rows.forEach(function (row, i) {
      var y = 8 + i * rowH;
      var wPrompt = peak ? (row.prompt / peak) * plotW : 0;
      var wCompletion = peak ? (row.completion / peak) * plotW : 0;
      var name = row.model.length > 24 ? row.model.slice(0, 23) + "…" : row.model;
      svg.appendChild(el("text", { x: left - 10, y: y + rowH / 2 + 1, "text-anchor": "end", "class": "label" }, name));
      var g = el("g", { "class": "bar", "data-model": row.model });
      g.appendChild(el("title", {}, tooltip(row, row.model)));
      g.appendChild(el("rect", { x: left, y: y + 4, width: wPrompt, height: rowH - 10, rx: 2, "class": "bar-prompt" }));
      g.appendChild(el("rect", { x: left + wPrompt, y: y + 4, width: wCompletion, height: rowH - 10, rx: 2,
        "class": "bar-completion" }));
      svg.appendChild(g);
      svg.appendChild(el("text", { x: left + wPrompt + wCompletion + 6, y: y + rowH / 2 + 1, "class": "tick" },
        compact(row.prompt + row.completion)));
    });
    if (!rows.length) emptyNote(svg, width, height);
    container.appendChild(svg);
  }

  var drawers = { daily: drawDaily, models: drawModels };
  document.querySelectorAll(".chart[data-chart]").forEach(function (container) {
    var source = document.getElementById(container.getAttribute("data-source"));
    var draw = drawers[container.getAttribute("data-chart")];
    if (!source || !draw) return;
    draw(container, JSON.parse(source.textContent));
  });
})();
