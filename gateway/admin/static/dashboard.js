// Draws the dashboard's charts (uPlot) from the JSON the server embedded in the page.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("chart-data").textContent);
  const palette = ["#2455c3", "#d1495b", "#00a676", "#edae49", "#7b4fbf", "#3c91e6", "#8c8c8c", "#f26419"];
  const formats = {
    "%": (v) => (v == null ? "–" : (v * 100).toFixed(1) + "%"),
    "$": (v) => (v == null ? "–" : "$" + (Math.abs(v) >= 1 ? v.toFixed(2) : v.toFixed(4))),
    "ms": (v) => (v == null ? "–" : Math.round(v) + " ms"),
  };

  function draw(id, chart) {
    const el = document.getElementById(id);
    if (!el || !chart) return;
    const title = document.createElement("div");
    title.className = "chart-title";
    title.textContent = el.dataset.title;
    el.appendChild(title);
    const hasData = chart.series.some((s) => s.values.some((v) => v != null && v !== 0));
    if (!hasData) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "Nothing to draw in this range.";
      el.appendChild(empty);
      return;
    }
    const fmt = formats[el.dataset.unit];
    const series = [{}];
    const columns = [chart.x];
    chart.series.forEach((s, i) => {
      const color = palette[i % palette.length];
      series.push({ label: s.name, stroke: color, width: 2, spanGaps: false, value: (u, v) => fmt(v), points: { size: 4 } });
      columns.push(s.values);
      const slo = chart.slo && chart.slo[s.name];
      if (slo != null) {  // the tier's SLO as a dashed line in the tier's colour
        series.push({ label: s.name + " SLO", stroke: color, width: 1, dash: [6, 4], value: (u, v) => fmt(v), points: { show: false } });
        columns.push(chart.x.map(() => slo));
      }
    });
    const opts = {
      width: Math.max(320, el.clientWidth - 4),
      height: 220,
      series: series,
      axes: [{}, { values: (u, ticks) => ticks.map(fmt), size: 64 }],
      scales: { y: { range: (u, min, max) => [0, max > 0 ? max * 1.08 : 1] } },
      cursor: { drag: { x: false, y: false } },
    };
    const plot = new uPlot(opts, columns, el);
    el.dataset.drawn = "true";
    window.addEventListener("resize", () => plot.setSize({ width: Math.max(320, el.clientWidth - 4), height: 220 }));
  }

  draw("chart-escalation", data.escalation);
  draw("chart-cost", data.cost);
  draw("chart-cache", data.cache);
  draw("chart-ttft", data.ttft);
  draw("chart-itl", data.itl);

  // The filters apply as soon as one changes.
  document.querySelectorAll("#filters select").forEach((select) =>
    select.addEventListener("change", () => document.getElementById("filters").submit()));
  document.querySelectorAll("form.revoke").forEach((form) =>
    form.addEventListener("submit", (event) => {
      if (!window.confirm("Revoke this key? Requests with it are refused from now on.")) event.preventDefault();
    }));
})();
