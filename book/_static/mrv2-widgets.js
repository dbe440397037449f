// Loaded between require.js and the widget manager (book/_config.yml, nb_ipywidgets_js).
// Each AMD module of the manager's bundle derives the URL of its webpack assets (fonts)
// from its require.js module URI; unmapped, that URI is relative to the page's own folder
// (a 404 there). Map every module the bundle defines onto the book's own copy.
(function () {
  var dir = new URL("vendor/html-manager/", new URL(".", document.currentScript.src)).href;
  var paths = {};
  ["base", "base7", "controls", "controls7", "output", "html-manager"].forEach(function (m) {
    paths["@jupyter-widgets/" + m] = dir + m;
  });
  paths["@jupyter-widgets/html-manager/dist"] = dir.slice(0, -1);
  require.config({paths: paths});
})();
