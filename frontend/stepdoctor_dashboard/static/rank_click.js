// The run page's rank chart: a click on a rank opens its trace. Each plotly trace says where the
// trace id sits in a point's customdata (meta.trace_at, rank_figures.py); ids are numbers, so the
// address is built from a number only. Runs after app.js (both deferred), which drew the plot.
(function () {
  var plot = document.getElementById("plot-ranks");
  if (!plot || typeof plot.on !== "function") return;
  plot.on("plotly_click", function (event) {
    var point = event && event.points && event.points[0];
    if (!point || !point.data || !point.data.meta) return;
    var id = Number((point.customdata || [])[point.data.meta.trace_at]);
    if (Number.isInteger(id) && id > 0) window.location.assign("/traces/" + id);
  });
  plot.style.cursor = "pointer";
})();
