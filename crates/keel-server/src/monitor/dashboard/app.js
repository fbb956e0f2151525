// Keel's live dashboard. Polls /dashboard/data every POLL_MS while the tab is visible and
// keeps the sparkline history the server sends (only samples it does not have yet).
// Everything from the server is set as text (never parsed as HTML).
'use strict';

const SVGNS = 'http://www.w3.org/2000/svg';
const POLL_MS = 2000;
const RETRY_MS = 5000;

// History: {seq, every, max, t: [], server: {from, v}, streams: {name: {from, v}}, consumers: {...}}
let hist = null;
// The previous poll's counters, for per-second rates between polls.
let prev = null;
let updates = 0;
let timer = null;
let busy = false;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('data-')) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function fmtNum(n) {
  if (n === null || n === undefined) return '–';
  if (Math.abs(n) >= 1e9) return (n / 1e9).toFixed(2) + 'G';
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(2) + 'M';
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + 'K';
  return Number.isInteger(n) ? n.toLocaleString('en-US') : n.toFixed(1);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? Math.round(n) : n.toFixed(1)) + ' ' + units[i];
}

function fmtRate(r) {
  if (r === null || r === undefined || !isFinite(r)) return '–';
  return fmtNum(Math.round(r * 10) / 10);
}

function fmtAgo(ms, now) {
  if (!ms) return 'never';
  const s = Math.max(0, (now - ms) / 1000);
  if (s < 1) return 'now';
  if (s < 120) return Math.round(s) + 's ago';
  if (s < 7200) return Math.round(s / 60) + 'm ago';
  return Math.round(s / 3600) + 'h ago';
}

// A sparkline of `values` (numbers; nulls are skipped).
function spark(values, cls) {
  const w = 120, h = 26;
  const svg = document.createElementNS(SVGNS, 'svg');
  svg.setAttribute('class', 'spark' + (cls ? ' ' + cls : ''));
  svg.setAttribute('width', w);
  svg.setAttribute('height', h);
  svg.setAttribute('viewBox', `0 0 ${w} ${h}`);
  const vs = values.filter((v) => v !== null && isFinite(v));
  if (vs.length < 2) return svg;
  const max = Math.max(...vs), min = Math.min(0, ...vs);
  const span = max - min || 1;
  const step = w / (vs.length - 1);
  const pts = vs.map((v, i) => `${(i * step).toFixed(1)},${(h - 2 - ((v - min) / span) * (h - 4)).toFixed(1)}`);
  const area = document.createElementNS(SVGNS, 'polygon');
  area.setAttribute('points', `0,${h} ${pts.join(' ')} ${w},${h}`);
  const line = document.createElementNS(SVGNS, 'polyline');
  line.setAttribute('points', pts.join(' '));
  svg.append(area, line);
  svg.setAttribute('data-points', String(vs.length));
  return svg;
}

// Per-second rate between consecutive samples of column `col`.
function rates(series, col, everyMs) {
  if (!series) return [];
  const out = [];
  for (let i = 1; i < series.v.length; i++) {
    out.push(Math.max(0, series.v[i][col] - series.v[i - 1][col]) / (everyMs / 1000));
  }
  return out;
}

const column = (series, col) => (series ? series.v.map((s) => s[col]) : []);

function mergeSeries(old, upd, max) {
  let s;
  if (old && upd.from === old.from + old.v.length) {
    s = { from: old.from, v: old.v.concat(upd.v) };
  } else if (old && upd.v.length === 0) {
    s = old;
  } else {
    s = { from: upd.from, v: upd.v.slice() };
  }
  while (s.v.length > max) { s.v.shift(); s.from++; }
  return s;
}

function mergeHistory(h) {
  if (!hist || h.seq < hist.seq) {
    // First load, or the server restarted: start over.
    hist = { seq: 0, every: h.every_ms, max: h.max, t: [], server: null, streams: {}, consumers: {} };
  }
  hist.every = h.every_ms;
  hist.max = h.max;
  hist.t = hist.t.concat(h.t).slice(-hist.max);
  hist.server = mergeSeries(hist.server, h.server, hist.max);
  for (const kind of ['streams', 'consumers']) {
    const next = {};
    // The server lists every tracked object each time; the rest are gone.
    for (const [k, upd] of Object.entries(h[kind])) next[k] = mergeSeries(hist[kind][k], upd, hist.max);
    hist[kind] = next;
  }
  hist.seq = h.seq;
}

function card(label, value, extra, cls) {
  return el('div', { class: 'card' + (cls ? ' ' + cls : ''), 'data-card': label },
    el('div', { class: 'label' }, label), el('div', { class: 'value' }, value), extra || null);
}

function bar(pct) {
  const d = el('div', { class: 'bar' + (pct >= 90 ? ' bad' : pct >= 75 ? ' warn' : '') });
  const fill = el('div');
  fill.style.width = Math.min(100, pct || 0) + '%';
  d.append(fill);
  return d;
}

function limitCell(s) {
  const parts = [];
  if (s.msgs_used !== null) parts.push(['msgs', s.msgs_used]);
  if (s.bytes_used !== null) parts.push(['bytes', s.bytes_used]);
  if (parts.length === 0) return el('td', { class: 'sub' }, 'no limit');
  const td = el('td');
  for (const [what, pct] of parts) {
    const m = el('span', { class: 'mini' }, bar(pct));
    td.append(m, el('span', { class: pct >= 90 ? 'bad-text' : pct >= 75 ? 'warn-text' : '' }, `${pct}% ${what} `));
  }
  return td;
}

function setRows(id, rows) {
  const tbody = $(id).querySelector('tbody');
  tbody.replaceChildren(...rows);
  $(id).classList.toggle('hidden', rows.length === 0);
  $(id + '-empty').classList.toggle('hidden', rows.length !== 0);
}

function render(d) {
  const s = d.server, now = d.now_ms;
  const dt = prev ? (now - prev.now) / 1000 : 0;
  const rate = (cur, old) => (prev && dt > 0 && old !== undefined ? Math.max(0, cur - old) / dt : null);

  $('server-name').textContent = s.name;
  $('server-meta').textContent = `nats-server ${s.version} API · keel ${s.keel_version} · up ${s.uptime} · ${s.cores} cores`;
  document.title = `Keel · ${s.name}`;

  const every = hist.every;
  const sv = hist.server;
  $('cards').replaceChildren(
    card('Connections', fmtNum(s.connections), spark(column(sv, 4))),
    card('Subscriptions', fmtNum(s.subscriptions)),
    card('Msgs in/s', fmtRate(rate(s.in_msgs, prev && prev.in_msgs)), spark(rates(sv, 0, every))),
    card('Msgs out/s', fmtRate(rate(s.out_msgs, prev && prev.out_msgs)), spark(rates(sv, 1, every))),
    card('Bytes in/s', fmtBytes(rate(s.in_bytes, prev && prev.in_bytes)), spark(rates(sv, 2, every))),
    card('Bytes out/s', fmtBytes(rate(s.out_bytes, prev && prev.out_bytes)), spark(rates(sv, 3, every))),
    card('Memory (RSS)', fmtBytes(s.mem), spark(column(sv, 5))),
    card('CPU', s.cpu.toFixed(1) + '%'),
    card('Slow consumers', fmtNum(s.slow_consumers), null, s.slow_consumers > 0 ? 'bad' : ''),
  );

  const js = s.jetstream;
  if (js) {
    const gauge = (label, used, max, pct) => el('div', { class: 'gauge', 'data-gauge': label },
      el('div', { class: 'label' }, label), bar(pct),
      el('div', {}, `${fmtBytes(used)} of ${fmtBytes(max)} (${pct === null ? '–' : pct + '%'})`));
    $('store').replaceChildren(
      gauge('Memory store', js.memory, js.max_memory, js.memory_used),
      gauge('File store', js.storage, js.max_storage, js.storage_used),
      el('div', { class: 'gauge' }, el('div', { class: 'label' }, 'JetStream API'),
        el('div', {}, `${fmtNum(js.api_total)} requests, ${fmtNum(js.api_errors)} errors (level ${js.api_level})`)),
    );
  }

  const prevStreams = (prev && prev.streams) || {};
  setRows('streams', d.streams.map((st) => {
    const h = hist.streams[st.name];
    const r = rate(st.last_seq, prevStreams[st.name]);
    return el('tr', { 'data-stream': st.name },
      el('td', { class: 'name' }, st.name, el('div', { class: 'sub' }, st.subjects.join(' '))),
      el('td', {}, st.storage),
      el('td', { class: 'num c-messages' }, fmtNum(st.messages)),
      el('td', {}, spark(column(h, 0))),
      el('td', { class: 'num' }, fmtBytes(st.bytes)),
      el('td', { class: 'num c-rate' }, fmtRate(r)),
      limitCell(st),
      el('td', { class: 'num' }, st.consumers),
      el('td', { class: 'num sub' }, `${st.first_seq}…${st.last_seq}`),
    );
  }));
  $('streams-count').textContent = `(${d.streams.length})`;

  const prevDelivered = (prev && prev.delivered) || {};
  setRows('consumers', d.consumers.map((c) => {
    const key = `${c.stream}/${c.name}`;
    const h = hist.consumers[key];
    const ackMax = c.max_ack_pending > 0 ? ` / ${fmtNum(c.max_ack_pending)}` : '';
    const nearMax = c.max_ack_pending > 0 && c.num_ack_pending >= 0.9 * c.max_ack_pending;
    return el('tr', { 'data-consumer': key },
      el('td', { class: 'name' }, c.stream, el('span', { class: 'sub' }, ' › '), c.name,
        el('div', { class: 'sub' }, c.pull ? 'pull' : 'push')),
      el('td', { class: 'num c-pending' }, fmtNum(c.num_pending)),
      el('td', {}, spark(column(h, 0))),
      el('td', { class: 'num c-ack-pending' + (nearMax ? ' bad-text' : '') }, fmtNum(c.num_ack_pending) + ackMax),
      el('td', {}, spark(column(h, 1), nearMax ? 'bad' : '')),
      el('td', { class: 'num c-redelivered' + (c.num_redelivered > 0 ? ' warn-text' : '') }, fmtNum(c.num_redelivered)),
      el('td', { class: 'num c-ack-floor' }, fmtNum(c.ack_floor)),
      el('td', { class: 'num c-delivered' }, fmtNum(c.delivered)),
      el('td', { class: 'num' }, fmtRate(rate(c.delivered, prevDelivered[key]))),
      el('td', { class: 'num c-waiting' }, c.pull ? `${fmtNum(c.num_waiting)} / ${fmtNum(c.max_waiting)}` : '–'),
      el('td', { class: 'num sub' }, fmtAgo(c.last_ack_ms, now)),
    );
  }));
  $('consumers-count').textContent = d.consumers.length < d.consumers_total
    ? `(${d.consumers.length} of ${d.consumers_total}, largest backlogs first)` : `(${d.consumers_total})`;

  setRows('slow', d.slow.map((c) => el('tr', {},
    el('td', {}, fmtAgo(c.stop_ms, now)),
    el('td', {}, `#${c.cid} ${c.name || ''}`, el('div', { class: 'sub' }, c.ip)),
    el('td', { class: 'bad-text' }, c.reason),
    el('td', { class: 'num' }, fmtNum(c.out_msgs)),
  )));
  $('slow-count').textContent = `(${fmtNum(s.slow_consumers)} since start)`;

  setRows('conns', d.connections.map((c) => el('tr', { 'data-cid': c.cid },
    el('td', {}, `#${c.cid} ${c.name || ''}`, el('div', { class: 'sub' }, `${c.ip} ${c.lang || ''}`)),
    el('td', { class: 'num' }, fmtNum(c.subs)),
    el('td', { class: 'num' + (c.pending > 0 ? ' warn-text' : '') }, fmtBytes(c.pending)),
    el('td', { class: 'num' }, fmtNum(c.in_msgs)),
    el('td', { class: 'num' }, fmtNum(c.out_msgs)),
  )));
  $('conns-count').textContent = d.connections.length < s.connections
    ? `(busiest ${d.connections.length} of ${s.connections})` : `(${s.connections})`;

  const streamsSeq = {};
  for (const st of d.streams) streamsSeq[st.name] = st.last_seq;
  const delivered = {};
  for (const c of d.consumers) delivered[`${c.stream}/${c.name}`] = c.delivered;
  prev = { now, in_msgs: s.in_msgs, out_msgs: s.out_msgs, in_bytes: s.in_bytes, out_bytes: s.out_bytes,
    streams: streamsSeq, delivered };
}

function setStatus(text, cls) {
  const st = $('status');
  st.textContent = text;
  st.className = 'status ' + cls;
  st.setAttribute('data-updates', String(updates));
}

async function poll() {
  timer = null;
  if (busy || document.visibilityState === 'hidden') return; // resumed by visibilitychange
  busy = true;
  try {
    const since = hist ? hist.seq : 0;
    const resp = await fetch(`/dashboard/data?since=${since}`, { cache: 'no-store' });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const d = await resp.json();
    mergeHistory(d.history);
    render(d);
    updates++;
    setStatus(`live · updated ${new Date(d.now_ms).toLocaleTimeString()}`, 'live');
    timer = setTimeout(poll, POLL_MS);
  } catch (e) {
    setStatus(`disconnected (${e.message}); retrying`, 'down');
    timer = setTimeout(poll, RETRY_MS);
  } finally {
    busy = false;
  }
}

document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible' && timer === null) poll();
});
poll();
