// Swagger UI for /docs (only when the server runs with --docs). Kept out of the page so the CSP needs no inline script.
window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true });
});
