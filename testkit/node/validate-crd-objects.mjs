// Validates custom resources (JSON files) with the @kubernetes-models packages of their CRDs:
// ServiceMonitor and PrometheusRule (prometheus-operator), Certificate and Issuer (cert-manager).
//   node validate-crd-objects.mjs NODE_MODULES FILE...
// Prints "ok FILE KIND" or "invalid FILE: why" per file; exits 1 if any is invalid or of a kind
// it has no model for.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, ...files] = process.argv.slice(2);
const models = {
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
  "cert-manager.io/v1": "@kubernetes-models/cert-manager/cert-manager.io/v1",
};
let failed = false;
for (const file of files) {
  const obj = JSON.parse(readFileSync(file, "utf8"));
  const dir = models[obj.apiVersion];
  if (!dir) {
    failed = true;
    console.log(`invalid ${file}: no model for ${obj.apiVersion} ${obj.kind}`);
    continue;
  }
  try {
    const mod = await import(pathToFileURL(join(modules, dir, `${obj.kind}.js`)).href);
    new mod[obj.kind](obj).validate();
    console.log(`ok ${file} ${obj.kind}`);
  } catch (e) {
    failed = true;
    console.log(`invalid ${file}: ${obj.kind}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
