// The OpenAPI description of this server, as text (nothing fetched from another site).
"use strict";

function element(tag, text, className) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (className) e.className = className;
  return e;
}

async function show() {
  const spec = await (await fetch("openapi.json")).json();
  document.getElementById("title").textContent = `${spec.info.title} ${spec.info.version}`;
  document.getElementById("description").textContent = spec.info.description || "";
  const paths = document.getElementById("paths");
  for (const [path, methods] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const section = element("section");
      section.append(element("h2", `${method.toUpperCase()} ${path}`), element("p", op.summary || ""));
      if (op.description) section.append(element("p", op.description, "quiet"));
      for (const p of op.parameters || []) {
        section.append(element("p", `parameter ${p.name} (${p.in}${p.required ? ", required" : ""}): ` +
                                    `${p.schema?.type || ""}${p.schema?.default !== undefined ? `, default ${p.schema.default}` : ""}`));
      }
      if (op.requestBody) section.append(element("p", `body: ${op.requestBody.description || ""}`));
      const table = element("table");
      for (const [status, r] of Object.entries(op.responses || {})) {
        const row = table.insertRow();
        row.insertCell().textContent = status;
        row.insertCell().textContent = r.description;
      }
      section.append(table);
      paths.append(section);
    }
  }
}

show();
