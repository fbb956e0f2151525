// Helpers shared by the nats.js tests: connections closed after each test, polling for a
// condition, raw pull requests, and worker child processes (lib/worker.mjs).

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { connect as natsConnect, createInbox } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";

export { isReference } from "./server.mjs";

/** Generous bound for anything that should happen "at once" (the machine is shared). */
export const STEP_MS = 5000;
export const SEC_NS = 1_000_000_000;

const WORKER = join(dirname(fileURLToPath(import.meta.url)), "worker.mjs");

/** A nats.js connection to `srv`, closed when the test ends. */
export async function connect(t, srv, opts = {}) {
  const nc = await natsConnect({ servers: srv.url, reconnect: false, ...opts });
  t.after(async () => {
    if (!nc.isClosed()) await nc.close().catch(() => {});
  });
  return nc;
}

/** Connection, JetStream client and manager. */
export async function setup(t, srv) {
  const nc = await connect(t, srv);
  const js = jetstream(nc, { timeout: STEP_MS });
  const jsm = await jetstreamManager(nc, { timeout: STEP_MS });
  return { nc, js, jsm };
}

export const sleep = (ms) => new Promise((ok) => setTimeout(ok, ms));

/** `promise`, or a failure naming `what` after `ms` (so a missing event fails, not hangs). */
export async function within(what, promise, ms = STEP_MS) {
  let timer;
  const timeout = new Promise((_, fail) => {
    timer = setTimeout(() => fail(new Error(`${what}: nothing within ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** Waits for a notification of `type` from a consumer's status() iterator; returns it. */
export function notified(status, type, what = type) {
  return within(
    `${what} notification`,
    (async () => {
      for await (const s of status) if (s.type === type) return s;
      throw new Error(`status ended before a ${type} notification`);
    })(),
  );
}

/**
 * Polls `fn` until it returns something truthy; fails with the last value after
 * `timeoutMs`. Some counters of the reference are updated asynchronously.
 */
export async function waitFor(what, fn, timeoutMs = STEP_MS) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    last = await fn();
    if (last) return last;
    if (Date.now() > deadline) {
      throw new Error(`${what}: condition not met within ${timeoutMs} ms (last: ${JSON.stringify(last)})`);
    }
    await sleep(20);
  }
}

/** Polls consumer info until `pred(info)` holds; returns that info. */
export function waitInfo(jsm, stream, consumer, what, pred) {
  let info;
  return waitFor(`${stream}.${consumer}: ${what}`, async () => {
    info = await jsm.consumers.info(stream, consumer);
    return pred(info) ? info : false;
  }).catch((err) => {
    err.message += `\nlast info: ${JSON.stringify(info)}`;
    throw err;
  });
}

/** (num_waiting, num_pending, num_ack_pending, delivered.consumer_seq) of a consumer info. */
export const counters = (i) => [i.num_waiting, i.num_pending, i.num_ack_pending, i.delivered.consumer_seq];

/**
 * A pull request sent with nats.js's core API (for request fields its consumer API does not
 * offer, e.g. `no_wait`). Returns a collector of everything that arrives on its inbox.
 */
export async function rawPull(nc, stream, consumer, body) {
  const inbox = createInbox();
  const got = [];
  let wake = null;
  const sub = nc.subscribe(inbox, {
    callback: (_err, m) => {
      got.push(m);
      wake?.();
    },
  });
  nc.publish(`$JS.API.CONSUMER.MSG.NEXT.${stream}.${consumer}`, JSON.stringify(body), { reply: inbox });
  await nc.flush();
  return {
    got,
    sub,
    /** The next message, waiting up to `ms`; null when nothing came. */
    async next(ms = STEP_MS) {
      const deadline = Date.now() + ms;
      while (got.length === 0) {
        const left = deadline - Date.now();
        if (left <= 0) return null;
        await new Promise((ok) => {
          const timer = setTimeout(ok, left);
          wake = () => {
            clearTimeout(timer);
            ok();
          };
        });
        wake = null;
      }
      return got.shift();
    },
  };
}

/** A message of a raw pull: `{status, description}` for a status, else a delivery. */
export function describeMsg(m) {
  const code = m.headers?.code ?? 0;
  if (code && !m.reply) return { status: code, description: m.headers.description };
  const tokens = (m.reply ?? "").split(".");
  return { subject: m.subject, data: m.string(), deliveries: Number(tokens[4]), streamSeq: Number(tokens[5]) };
}

/**
 * Starts `node lib/worker.mjs <mode> <args...>` with the server URL in the environment.
 * `lines()` yields its stdout lines; `untilLine(prefix)` waits for one starting with it.
 */
export function spawnWorker(t, srv, mode, ...args) {
  const proc = spawn(process.execPath, [WORKER, mode, ...args.map(String)], {
    env: { ...process.env, KEEL_WORKER_URL: srv.url },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (c) => (stderr = (stderr + c).slice(-8000)));
  const exited = new Promise((ok) => proc.on("exit", (code, signal) => ok({ code, signal })));
  const rl = createInterface({ input: proc.stdout });
  const queue = [];
  let wake = null;
  let ended = false;
  rl.on("line", (l) => {
    queue.push(l);
    wake?.();
  });
  rl.on("close", () => {
    ended = true;
    wake?.();
  });
  t.after(async () => {
    if (proc.exitCode === null && proc.signalCode === null) {
      proc.kill("SIGKILL");
      await exited;
    }
  });
  const nextLine = async (ms) => {
    const deadline = Date.now() + ms;
    while (queue.length === 0) {
      if (ended) return null;
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`worker ${mode}: no output within ${ms} ms; stderr:\n${stderr}`);
      await new Promise((ok) => {
        const timer = setTimeout(ok, left);
        wake = () => {
          clearTimeout(timer);
          ok();
        };
      });
      wake = null;
    }
    return queue.shift();
  };
  return {
    proc,
    exited,
    stderr: () => stderr,
    nextLine,
    async untilLine(prefix, ms = 15_000) {
      for (;;) {
        const l = await nextLine(ms);
        if (l === null) {
          const { code, signal } = await exited;
          throw new Error(`worker ${mode} exited (${code ?? signal}) before "${prefix}"; stderr:\n${stderr}`);
        }
        if (l.startsWith(prefix)) return l;
      }
    },
    /** SIGKILL, as a crash or `kill -9` would. */
    async sigkill() {
      proc.kill("SIGKILL");
      return exited;
    },
  };
}
