#!/usr/bin/env node
// Type-check the shipped Grafana dashboards against the `Dashboard` type of @grafana/schema.
//
// For each dashboard JSON this writes `import type { Dashboard } ...; const d: Dashboard = <json>;`
// into a temporary directory and runs `tsc --noEmit --strict` on all of them. Object-literal
// excess-property checks catch misspelled or misplaced keys; literal unions catch bad enum strings.
//
// JSON strings cannot be assigned to TypeScript *string enums* (ThresholdsMode, FieldColorModeId,
// MappingType, SpecialValueMatch), so at those known paths the generator emits the enum member whose
// value equals the string, and fails if there is none (a typo such as "absolut" is an error too).
//
// Usage: node check.mjs [dashboard.json ...]   (default: every ../*.json)
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import * as schema from '@grafana/schema';

const here = path.dirname(fileURLToPath(import.meta.url));

// Path suffixes (object keys, `*` for an array index) whose string value is a string enum.
const ENUM_PATHS = [
  { suffix: ['fieldConfig', 'defaults', 'thresholds', 'mode'], name: 'ThresholdsMode' },
  { suffix: ['fieldConfig', 'defaults', 'color', 'mode'], name: 'FieldColorModeId' },
  { suffix: ['fieldConfig', 'defaults', 'mappings', '*', 'type'], name: 'MappingType' },
  { suffix: ['fieldConfig', 'defaults', 'mappings', '*', 'options', 'match'], name: 'SpecialValueMatch' },
];

function enumAt(keyPath) {
  for (const { suffix, name } of ENUM_PATHS) {
    if (keyPath.length < suffix.length) continue;
    const tail = keyPath.slice(keyPath.length - suffix.length);
    if (tail.every((k, i) => k === suffix[i])) return name;
  }
  return undefined;
}

function enumMember(enumName, value, keyPath, file) {
  const members = schema[enumName];
  const key = Object.keys(members).find((k) => members[k] === value);
  if (key === undefined) {
    const allowed = Object.values(members).join(', ');
    throw new Error(`${file}: ${keyPath.join('.')} = ${JSON.stringify(value)} is not a ${enumName} (one of: ${allowed})`);
  }
  return `${enumName}.${key}`;
}

// Render a JSON value as a TypeScript expression; `used` collects the enum names referenced.
function toTs(value, keyPath, file, used, indent) {
  const pad = '  '.repeat(indent + 1);
  const end = '  '.repeat(indent);
  if (Array.isArray(value)) {
    if (value.length === 0) return '[]';
    const items = value.map((v) => pad + toTs(v, [...keyPath, '*'], file, used, indent + 1));
    return `[\n${items.join(',\n')}\n${end}]`;
  }
  if (value !== null && typeof value === 'object') {
    const entries = Object.entries(value);
    if (entries.length === 0) return '{}';
    const items = entries.map(
      ([k, v]) => `${pad}${JSON.stringify(k)}: ${toTs(v, [...keyPath, k], file, used, indent + 1)}`,
    );
    return `{\n${items.join(',\n')}\n${end}}`;
  }
  if (typeof value === 'string') {
    const enumName = enumAt(keyPath);
    if (enumName !== undefined) {
      used.add(enumName);
      return enumMember(enumName, value, keyPath, file);
    }
  }
  return JSON.stringify(value);
}

export function generate(jsonText, file) {
  const dashboard = JSON.parse(jsonText);
  const used = new Set();
  const body = toTs(dashboard, [], file, used, 0);
  const enums = [...used].sort();
  const lines = ["import type { Dashboard } from '@grafana/schema';"];
  if (enums.length > 0) lines.push(`import { ${enums.join(', ')} } from '@grafana/schema';`);
  lines.push('', `const dashboard: Dashboard = ${body};`, '', 'export default dashboard;', '');
  return lines.join('\n');
}

function main(argv) {
  const files =
    argv.length > 0
      ? argv.map((f) => path.resolve(f))
      : fs
          .readdirSync(path.join(here, '..'))
          .filter((f) => f.endsWith('.json'))
          .sort()
          .map((f) => path.join(here, '..', f));
  if (files.length === 0) {
    console.error('check: no dashboard JSON files found');
    return 2;
  }
  const tsc = path.join(here, 'node_modules', '.bin', 'tsc');
  if (!fs.existsSync(tsc)) {
    console.error(`check: ${tsc} is missing; run scripts/install-tools.sh (npm ci in dashboards/check)`);
    return 2;
  }
  const out = fs.mkdtempSync(path.join(os.tmpdir(), 'kvobserve-dashboards-'));
  try {
    const generated = [];
    for (const file of files) {
      const base = path.basename(file, '.json').replace(/[^A-Za-z0-9_-]/g, '_');
      const target = path.join(out, `${base}.ts`);
      try {
        fs.writeFileSync(target, generate(fs.readFileSync(file, 'utf8'), path.basename(file)));
      } catch (err) {
        console.error(`check: ${err.message}`);
        return 1;
      }
      generated.push(target);
    }
    // The temporary project extends ours, so module paths resolve to dashboards/check/node_modules.
    const tsconfig = { extends: path.join(here, 'tsconfig.json'), files: generated };
    fs.writeFileSync(path.join(out, 'tsconfig.json'), JSON.stringify(tsconfig, null, 2));
    const result = spawnSync(tsc, ['-p', path.join(out, 'tsconfig.json'), '--noEmit', '--strict'], {
      encoding: 'utf8',
    });
    process.stdout.write(result.stdout ?? '');
    process.stderr.write(result.stderr ?? '');
    if (result.status !== 0) {
      console.error(`check: tsc failed (exit ${result.status}) on ${files.length} dashboard(s)`);
      return 1;
    }
    console.log(`check: ${files.length} dashboard(s) type-check as @grafana/schema Dashboard`);
    return 0;
  } finally {
    fs.rmSync(out, { recursive: true, force: true });
  }
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  process.exitCode = main(process.argv.slice(2));
}
