// Validates ServiceMonitor JSON files with @kubernetes-models/prometheus-operator.
//   node validate-servicemonitor.mjs NODE_MODULES FILE...
// Prints "ok FILE" or "invalid FILE: why" per file; exits 1 if any is invalid.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, ...files] = process.argv.slice(2);
const url = pathToFileURL(
  join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js"),
);
const { ServiceMonitor } = await import(url.href);
let failed = false;
for (const file of files) {
  try {
    new ServiceMonitor(JSON.parse(readFileSync(file, "utf8"))).validate();
    console.log(`ok ${file}`);
  } catch (e) {
    failed = true;
    console.log(`invalid ${file}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
