// Countdowns, queue polling and rollback confirmation. No inline scripts: the CSP forbids them.
(function () {
  "use strict";
  function fmt(seconds) {
    if (seconds <= 0) return "timed out";
    var h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = Math.floor(seconds % 60);
    var mm = (m < 10 && h ? "0" : "") + m, ss = (s < 10 ? "0" : "") + s;
    return (h ? h + ":" : "") + mm + ":" + ss;
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll(".countdown[data-deadline]").forEach(function (el) {
      var left = (Date.parse(el.getAttribute("data-deadline")) - now) / 1000;
      el.textContent = fmt(left);
      el.classList.toggle("soon", left < 60);
    });
  }
  function poll() {
    var body = document.getElementById("queue-rows");
    if (!body) return;
    var period = parseFloat(document.getElementById("refreshed").getAttribute("data-poll")) || 3;
    var known = {};
    body.querySelectorAll("tr[data-id]").forEach(function (tr) { known[tr.getAttribute("data-id")] = true; });
    setInterval(function () {
      fetch(body.getAttribute("data-src"), { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { if (r.status === 401) { location.href = "/ui/login"; } return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html === null || html === undefined) return;
          body.innerHTML = html;
          body.querySelectorAll("tr[data-id]").forEach(function (tr) {
            var id = tr.getAttribute("data-id");
            if (!known[id]) { tr.classList.add("fresh"); known[id] = true; }
          });
          var stamp = document.getElementById("refreshed");
          stamp.textContent = "updated " + new Date().toLocaleTimeString();
          tick();
        })
        .catch(function () { /* keep the last view; the next poll retries */ });
    }, period * 1000);
  }
  document.addEventListener("DOMContentLoaded", function () {
    tick();
    setInterval(tick, 1000);
    poll();
    document.querySelectorAll("form[data-confirm]").forEach(function (f) {
      f.addEventListener("submit", function (e) {
        if (!window.confirm(f.getAttribute("data-confirm"))) e.preventDefault();
      });
    });
  });
})();
