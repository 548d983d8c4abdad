// Figures from the server's plotly JSON, and tables sortable by clicking a column header.
document.querySelectorAll("script[type='application/json'][data-plot]").forEach(function (node) {
  var fig = JSON.parse(node.textContent);
  Plotly.newPlot(node.dataset.plot, fig.data, fig.layout, {displaylogo: false, responsive: true});
});
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th[data-sort]").forEach(function (th, col) {
    th.tabIndex = 0;
    th.title = "sort";
    var sort = function () {
      var numeric = th.dataset.sort === "num";
      var down = th.getAttribute("aria-sort") !== "descending";
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = a.cells[col], y = b.cells[col];
        var vx = numeric ? parseFloat(x.dataset.v) : x.textContent.trim().toLowerCase();
        var vy = numeric ? parseFloat(y.dataset.v) : y.textContent.trim().toLowerCase();
        var r = vx < vy ? -1 : vx > vy ? 1 : 0;
        return down ? -r : r;
      });
      table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", down ? "descending" : "ascending");
      rows.forEach(function (row) { body.appendChild(row); });
    };
    th.addEventListener("click", sort);
    th.addEventListener("keydown", function (e) { if (e.key === "Enter") sort(); });
  });
});
document.querySelectorAll("button.show-more").forEach(function (button) {
  button.addEventListener("click", function () {
    document.querySelectorAll("#" + button.dataset.table + " tr.more").forEach(function (row) { row.hidden = false; });
    button.remove();
  });
});
