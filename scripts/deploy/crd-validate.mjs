// Validates custom resources against their CRD schemas — KEDA's
// (@kubernetes-models/keda) and the Prometheus Operator's
// (@kubernetes-models/prometheus-operator) — and strictly: a field the CRD does not
// declare is an error too (the compiled validators accept unknown fields; the
// packages' type declarations list every declared one).
//
//   node crd-validate.mjs <dir holding node_modules> <file of a JSON array of objects>
//
// Prints one line per object ("ok kind/name" or "ERROR kind/name: why") and exits 1
// when any object is not valid.
import { readFileSync, existsSync } from "node:fs";
import { join, dirname } from "node:path";
import { pathToFileURL } from "node:url";

const [npmDir, file] = process.argv.slice(2);
const objects = JSON.parse(readFileSync(file, "utf8"));

// The models this chart may render, by apiVersion and kind: their package, and the
// model's path in it.
const models = {
  "keda.sh/v1alpha1/ScaledObject": ["keda", "keda.sh/v1alpha1/ScaledObject"],
  "keda.sh/v1alpha1/ScaledJob": ["keda", "keda.sh/v1alpha1/ScaledJob"],
  "keda.sh/v1alpha1/TriggerAuthentication": ["keda", "keda.sh/v1alpha1/TriggerAuthentication"],
  "monitoring.coreos.com/v1/PrometheusRule": ["prometheus-operator", "monitoring.coreos.com/v1/PrometheusRule"],
};

// Declared fields of an interface in a .d.ts file: { field: typeText }, following the
// file's imports to the files of nested interfaces.
function declaredFields(dtsPath) {
  const text = readFileSync(dtsPath, "utf8");
  const imports = {};
  for (const m of text.matchAll(/import \{ ([^}]+) \} from "([^"]+)";/g)) {
    for (const name of m[1].split(",").map((s) => s.trim())) imports[name] = m[2];
  }
  const body = text.match(/export interface \w+(?: extends [\w, ]+)? \{\n([\s\S]*?)\n\}/);
  if (!body) return null;
  const fields = {};
  // Top-level members are indented by exactly four spaces.
  for (const m of body[1].matchAll(/^    "([^"]+)"\??: ([^\n]*)$/gm)) fields[m[1]] = m[2].replace(/;$/, "");
  return { fields, imports, dir: dirname(dtsPath) };
}

function resolveImport(fromDir, spec) {
  if (spec.startsWith(".")) return join(fromDir, spec.replace(/\.js$/, ".d.ts"));
  // A package: @kubernetes-models/apimachinery/… → node_modules/…
  const p = join(npmDir, "node_modules", spec + ".d.ts");
  return existsSync(p) ? p : null;
}

// Unknown fields of `value` against the interface in `dtsPath`, as JSON paths.
function unknownFields(value, dtsPath, path, out) {
  if (value === null || typeof value !== "object" || Array.isArray(value) || !dtsPath) return;
  const decl = declaredFields(dtsPath);
  if (!decl) return;
  for (const [key, v] of Object.entries(value)) {
    const type = decl.fields[key];
    if (type === undefined) {
      // TypeMeta fields are declared on the base interface.
      if (!(path === "" && (key === "apiVersion" || key === "kind"))) out.push(`${path}/${key}`);
      continue;
    }
    const nested = type.match(/^(?:Array<)?(I\w+)>?$/);
    if (!nested || !decl.imports[nested[1]]) continue;
    const target = resolveImport(decl.dir, decl.imports[nested[1]]);
    if (Array.isArray(v)) v.forEach((item, i) => unknownFields(item, target, `${path}/${key}/${i}`, out));
    else unknownFields(v, target, `${path}/${key}`, out);
  }
}

let failed = 0;
for (const object of objects) {
  const id = `${object.kind}/${object.metadata?.name}`;
  const found = models[`${object.apiVersion}/${object.kind}`];
  if (!found) {
    console.log(`ERROR ${id}: no CRD schema for ${object.apiVersion} ${object.kind}`);
    failed++;
    continue;
  }
  const [name, model] = found;
  const pkg = join(npmDir, "node_modules", "@kubernetes-models", name);
  const modulePath = join(pkg, model + ".js");
  const Model = (await import(pathToFileURL(modulePath).href))[object.kind];
  const problems = [];
  try {
    new Model(object).validate();
  } catch (err) {
    problems.push(err.message);
  }
  const unknown = [];
  unknownFields(object, join(pkg, model + ".d.ts"), "", unknown);
  if (unknown.length) problems.push(`fields the CRD does not declare: ${unknown.join(", ")}`);
  if (problems.length) {
    console.log(`ERROR ${id}: ${problems.join("; ")}`);
    failed++;
  } else {
    console.log(`ok ${id}`);
  }
}
process.exit(failed ? 1 : 0);
