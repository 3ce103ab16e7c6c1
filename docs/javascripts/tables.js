// A table wider than its column is shown row by row (extra.css, table[data-opd-stacked]):
// each row a block, each cell a line "heading: value" (docs/hooks/tables.py copies the
// headings into the cells). Only a table that does not fit is changed; the others keep their
// grid. Measured again when the window's width changes and when a <details> opens, since a
// table in a closed one has no width.
(function () {
  "use strict";

  function contentWidth(element) {
    const style = getComputedStyle(element);
    return element.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  }

  function fit() {
    for (const table of document.querySelectorAll("article table")) {
      if (!table.querySelector("td > .opd-cell-label")) continue;
      // Material wraps a table in .md-typeset__scrollwrap > .md-typeset__table; the column is
      // what holds that wrapper.
      const holder = (table.closest(".md-typeset__scrollwrap") || table).parentElement;
      table.removeAttribute("data-opd-stacked");
      const column = contentWidth(holder);
      if (column > 0 && table.scrollWidth > column + 1) table.setAttribute("data-opd-stacked", "");
    }
  }

  let pending = false;
  function later() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; fit(); });
  }

  if (typeof document$ !== "undefined") document$.subscribe(fit);  // Material's page events
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", fit);
  else fit();
  window.addEventListener("resize", later);
  document.addEventListener("toggle", later, true);
})();
