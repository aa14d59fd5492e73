// Validates Grafana dashboard JSON files against Grafana's own schema: the TypeScript types of
// npm @grafana/schema (dashboard kind, x/types.gen.d.ts) turned into JSON Schema with
// ts-json-schema-generator, checked with ajv. The schema is stricter than Grafana at the top
// level (it rejects `__inputs`, `__requires`), so only there are additional properties allowed;
// panels, variables, targets' shape and so on are checked as the types say.
//   node validate-grafana-dashboard.mjs NODE_MODULES FILE...
// Prints "ok FILE" or "invalid FILE: why" per file; exits 1 if any is invalid.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join, resolve } from "node:path";

const [modules, ...files] = process.argv.slice(2);
if (!modules || files.length === 0) {
  console.error("usage: validate-grafana-dashboard.mjs NODE_MODULES FILE...");
  process.exit(2);
}
const require = createRequire(join(resolve(modules), "noop.js"));
const tsj = require("ts-json-schema-generator");
const Ajv = require("ajv");

const types = join(modules, "@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts");
const schema = tsj
  .createGenerator({ path: types, type: "Dashboard", skipTypeCheck: true })
  .createSchema("Dashboard");
const top = schema.definitions.Dashboard;
if (!top || !top.properties || !top.properties.panels || !top.properties.templating) {
  console.error(`unexpected schema from ${types}: no Dashboard with panels and templating`);
  process.exit(2);
}
top.additionalProperties = true;

const ajv = new Ajv({ allErrors: true, strict: false });
const validate = ajv.compile(schema);
let failed = false;
for (const file of files) {
  let doc;
  try {
    doc = JSON.parse(readFileSync(file, "utf8"));
  } catch (e) {
    failed = true;
    console.log(`invalid ${file}: ${e.message}`);
    continue;
  }
  if (validate(doc)) {
    console.log(`ok ${file}`);
  } else {
    failed = true;
    const why = validate.errors
      .slice(0, 10)
      .map((e) => `${e.instancePath || "/"} ${e.message} ${JSON.stringify(e.params)}`)
      .join("; ");
    console.log(`invalid ${file}: ${why}`);
  }
}
process.exit(failed ? 1 : 0);
