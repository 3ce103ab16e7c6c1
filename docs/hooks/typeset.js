// Typeset TeX with MathJax 3 at build time, for docs/hooks/typeset.py.
//
// Usage: node typeset.js ES5_DIR. MathJax's es5 components (the copy that the
// django-static-mathjax wheel ships) are loaded from ES5_DIR. One JSON request a line on stdin:
//   {"tex": "...", "display": true}  ->  {"html": "<mjx-container ...>", "mathml": "<math ...>"}
//                                     or {"error": "Undefined control sequence \\foo"}
//   {"stylesheet": true}             ->  {"css": "..."}  (the CSS of every glyph typeset so far)
// One JSON answer a line on stdout, in the order of the requests.
"use strict";

const readline = require("readline");

const es5 = process.argv[2];
if (!es5) {
  process.stderr.write("usage: node typeset.js ES5_DIR\n");
  process.exit(2);
}

require(es5 + "/node-main.js").init({
  // tex-full: every TeX extension loaded up front, so nothing autoloads in the middle of a
  // formula (autoloading needs a retry that the synchronous tex2chtml does not do).
  loader: {load: ["input/tex-full", "output/chtml"]},
  tex: {
    // Without noundefined an unknown macro is an error, not a red \foo in the page.
    packages: {"[-]": ["noundefined"]},
    // Raise TeX errors instead of typesetting them as a red <merror>: the build must fail.
    formatError: (jax, error) => { throw error; },
  },
  // The fonts lie next to the stylesheet in the built site (the hook copies them there).
  chtml: {fontURL: "woff-v2", adaptiveCSS: true},
}).then((MathJax) => {
  const adaptor = MathJax.startup.adaptor;
  const lines = readline.createInterface({input: process.stdin, terminal: false});
  lines.on("line", (line) => {
    const request = JSON.parse(line);
    let answer;
    if (request.stylesheet) {
      answer = {css: adaptor.textContent(MathJax.chtmlStylesheet())};
    } else {
      try {
        // Layout as in the site's content column: 16 px text, a column about 800 px wide.
        const options = {display: request.display, em: 16, ex: 8, containerWidth: 800};
        const html = adaptor.outerHTML(MathJax.tex2chtml(request.tex, options));
        const mathml = MathJax.tex2mml(request.tex, {display: request.display});
        answer = {html: html, mathml: mathml};
      } catch (error) {
        answer = {error: String(error.message || error)};
      }
    }
    process.stdout.write(JSON.stringify(answer) + "\n");
  });
}).catch((error) => {
  process.stderr.write("MathJax failed to start: " + (error.stack || error) + "\n");
  process.exit(1);
});
