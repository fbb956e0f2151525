// Loads the dashboard in headless Chromium, waits until its numbers appear and then change
// (the calling test keeps publishing), checks the sparklines drew, saves a screenshot and
// prints what it saw as one JSON line. Exit code 0 only if every check passed.
//
//   node check.mjs <dashboard url> <screenshot.png> [stream] [consumer]
//
// Chromium: $KEEL_CHROMIUM or /usr/bin/chromium. Nothing is fetched from the internet: the
// page is served by keel-server, and playwright-core drives the system browser.
import { chromium } from 'playwright-core';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const [url, shot, stream = 'ORDERS', consumer = 'order-worker'] = process.argv.slice(2);
if (!url || !shot) {
  console.error('usage: node check.mjs <url> <screenshot.png> [stream] [consumer]');
  process.exit(2);
}
const profile = mkdtempSync(join(tmpdir(), 'keel-dash-profile-'));
// A fresh profile directory (playwright passes it as --user-data-dir).
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.KEEL_CHROMIUM || '/usr/bin/chromium',
  headless: true,
  // As root in CI: no sandbox; no GPU, QUIC, first-run, background or update traffic.
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  viewport: { width: 1400, height: 1000 },
  timeout: 60_000,
});
const out = { ok: false };
const errors = [];
try {
  const page = await browser.newPage();
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  // Anything but our own server would be a CDN or other outside dependency.
  const origin = new URL(url).origin;
  const foreign = [];
  page.on('request', (r) => {
    if (!r.url().startsWith(origin) && !r.url().startsWith('data:')) foreign.push(r.url());
  });
  page.on('response', (r) => { if (r.status() >= 400) errors.push(`${r.status()} ${r.url()}`); });
  await page.goto(url, { waitUntil: 'load', timeout: 30_000 });

  const row = `tr[data-stream="${stream}"]`;
  const crow = `tr[data-consumer="${stream}/${consumer}"]`;
  await page.waitForSelector(`${row} .c-messages`, { timeout: 30_000 });
  await page.waitForSelector(`${crow} .c-pending`, { timeout: 30_000 });
  const read = async () => ({
    messages: await page.textContent(`${row} .c-messages`),
    pending: await page.textContent(`${crow} .c-pending`),
    ack_floor: await page.textContent(`${crow} .c-ack-floor`),
    updates: Number(await page.getAttribute('#status', 'data-updates')),
    status: await page.textContent('#status'),
  });
  out.first = await read();
  // The numbers change on their own: the page polls, the test publishes.
  await page.waitForFunction(
    ([sel, before]) => document.querySelector(sel)?.textContent !== before,
    [`${row} .c-messages`, out.first.messages],
    { timeout: 60_000 },
  );
  // Sparklines need two samples (taken every 5 s); a documentation screenshot may ask for
  // more (KEEL_DASHBOARD_MIN_POINTS).
  const minPoints = Number(process.env.KEEL_DASHBOARD_MIN_POINTS || 2);
  await page.waitForFunction(
    ([sel, n]) => Number(document.querySelector(sel)?.getAttribute('data-points') || 0) >= n,
    [`${row} svg.spark`, minPoints],
    { timeout: 60_000 + minPoints * 5_000 },
  );
  out.later = await read();
  out.sparkline_points = Number(await page.getAttribute(`${row} svg.spark`, 'data-points'));
  out.consumer_sparkline_points = Number(await page.getAttribute(`${crow} svg.spark`, 'data-points'));
  out.cards = await page.$$eval('[data-card]', (cs) => cs.map((c) => c.getAttribute('data-card')));
  await page.screenshot({ path: shot, fullPage: true });
  out.foreign_requests = foreign;
  out.errors = errors;
  out.ok = foreign.length === 0 && errors.length === 0 && out.later.updates > out.first.updates;
} catch (e) {
  out.error = String(e);
  out.errors = errors;
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
console.log(JSON.stringify(out));
process.exit(out.ok ? 0 : 1);
