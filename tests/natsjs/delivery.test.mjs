// Issue 10 item 1, as nats.js workers see it: a pull request whose requester went away
// (consume() stopped, connection closed, process SIGKILLed) gets nothing, does not count
// in num_waiting, and nothing given to no one counts as delivered. Plus the seed
// walkthrough with nats.js workers, one of them killed with SIGKILL.

import { test } from "node:test";
import assert from "node:assert/strict";

import { AckPolicy, DeliverPolicy, RetentionPolicy, StorageType } from "@nats-io/jetstream";

import { startServer } from "./lib/server.mjs";
import { counters, isReference, notified, SEC_NS, setup, sleep, spawnWorker, STEP_MS, waitInfo } from "./lib/util.mjs";

async function jobs(jsm, consumer = {}) {
  await jsm.streams.add({ name: "JOBS", subjects: ["jobs.>"], storage: StorageType.Memory });
  await jsm.consumers.add("JOBS", { durable_name: "worker", ack_policy: AckPolicy.Explicit, ...consumer });
}

/** The next worker: one message, at once, and its delivery count. */
async function nextWorker(js) {
  const c = await js.consumers.get("JOBS", "worker");
  const m = await c.next({ expires: STEP_MS });
  assert.ok(m, "the next worker got nothing");
  await m.ackAck();
  return [m.string(), m.info.deliveryCount];
}

test("consume() stopped, then one publish: pending for the next worker, delivered once", async (t) => {
  const srv = await startServer(t);
  const { nc, js, jsm } = await setup(t, srv);
  await jobs(jsm);
  const c = await js.consumers.get("JOBS", "worker");
  // nats.js defaults: 100 messages, 30 s requests, 15 s heartbeats.
  const msgs = await c.consume();
  const loop = (async () => {
    for await (const m of msgs) assert.fail(`consume() got ${m.string()}`);
  })();
  await waitInfo(jsm, "JOBS", "worker", "consume() request waiting", (i) => i.num_waiting === 1);
  await msgs.close();
  await loop;
  await nc.flush();
  await js.publish("jobs.new", "job-1");
  const info = await waitInfo(jsm, "JOBS", "worker", "num_pending 1", (i) => i.num_pending === 1);
  assert.deepEqual(counters(info), [0, 1, 0, 0], "num_waiting, num_pending, num_ack_pending, delivered");
  assert.deepEqual(await nextWorker(js), ["job-1", 1]);
});

test("worker connection closed mid-long-poll, max_deliver 3: the next worker gets the message", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await jobs(jsm, { max_deliver: 3, ack_wait: SEC_NS });
  const { nc: wnc, js: wjs } = await setup(t, srv);
  const c = await wjs.consumers.get("JOBS", "worker");
  const msgs = await c.fetch({ max_messages: 1, expires: 30_000 });
  const loop = (async () => {
    try {
      for await (const m of msgs) assert.fail(`the closed worker got ${m.string()}`);
    } catch {
      // ended by the close
    }
  })();
  await waitInfo(jsm, "JOBS", "worker", "long poll waiting", (i) => i.num_waiting === 1);
  await wnc.close();
  await loop;
  await waitInfo(jsm, "JOBS", "worker", "request of the closed worker gone", (i) => i.num_waiting === 0);
  await js.publish("jobs.new", "job-1");
  // Longer than three ack waits: nothing may be used up on the dead request meanwhile.
  const info = await waitInfo(jsm, "JOBS", "worker", "num_pending 1", (i) => i.num_pending === 1);
  assert.deepEqual(counters(info), [0, 1, 0, 0]);
  assert.deepEqual(await nextWorker(js), ["job-1", 1]);
});

test("worker process SIGKILLed during fetch(): its request is dropped", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await jobs(jsm);
  const w = spawnWorker(t, srv, "long-poll", "JOBS", "worker", 30_000);
  await w.untilLine("READY");
  await waitInfo(jsm, "JOBS", "worker", "long poll waiting", (i) => i.num_waiting === 1);
  await w.sigkill();
  await waitInfo(jsm, "JOBS", "worker", "request of the killed worker gone", (i) => i.num_waiting === 0);
  for (let n = 1; n <= 5; n++) await js.publish("jobs.new", `job-${n}`);
  const info = await waitInfo(jsm, "JOBS", "worker", "num_pending 5", (i) => i.num_pending === 5);
  assert.deepEqual(counters(info), [0, 5, 0, 0]);
  const c = await js.consumers.get("JOBS", "worker");
  const got = [];
  for await (const m of await c.fetch({ max_messages: 5, expires: STEP_MS })) {
    got.push([m.string(), m.info.deliveryCount]);
    m.ack();
  }
  assert.deepEqual(got, [1, 2, 3, 4, 5].map((n) => [`job-${n}`, 1]));
});

test("a crash-looping worker cannot fill max_waiting", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await jobs(jsm, { max_waiting: 2 });
  for (let n = 0; n < 4; n++) {
    if (isReference()) {
      // The reference drops dead requests of a full queue at most once a second (a real
      // crash loop is that slow); Keel drops each one when its requester goes away.
      await sleep(1100);
    }
    const w = spawnWorker(t, srv, "long-poll", "JOBS", "worker", 30_000);
    await w.untilLine("READY");
    await w.sigkill();
  }
  const c = await js.consumers.get("JOBS", "worker");
  const msgs = await c.fetch({ max_messages: 1, expires: 10_000 });
  const status = msgs.status();
  const got = (async () => {
    const out = [];
    for await (const m of msgs) {
      out.push([m.string(), m.info.deliveryCount]);
      m.ack();
    }
    return out;
  })();
  await notified(status, "next", "pull request sent");
  await waitInfo(jsm, "JOBS", "worker", "the live worker waiting", (i) => i.num_waiting >= 1);
  await js.publish("jobs.new", "job");
  assert.deepEqual(await got, [["job", 1]]);
});

test("seed walkthrough: a worker acks 1 and 2 and is SIGKILLed; a restarted worker gets only 3", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await jsm.streams.add({
    name: "ORDERS",
    subjects: ["orders.>"],
    retention: RetentionPolicy.Limits,
    max_age: 24 * 3600 * SEC_NS,
    storage: StorageType.File,
  });
  const si = await jsm.streams.info("ORDERS");
  assert.equal(si.config.max_age, 24 * 3600 * SEC_NS);
  assert.equal(si.config.storage, "file");
  await jsm.consumers.add("ORDERS", {
    durable_name: "order-worker",
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
  });
  for (let id = 1; id <= 3; id++) {
    const ack = await js.publish("orders.new", JSON.stringify({ id }));
    assert.equal(ack.seq, id);
  }
  const worker = spawnWorker(t, srv, "ack", "ORDERS", "order-worker", 2);
  assert.equal(await worker.untilLine("ACKED"), 'ACKED {"id":1} 1');
  assert.equal(await worker.untilLine("ACKED"), 'ACKED {"id":2} 1');
  await worker.untilLine("IDLE");
  await worker.sigkill();
  const info = await jsm.consumers.info("ORDERS", "order-worker");
  assert.deepEqual([info.delivered.consumer_seq, info.delivered.stream_seq], [2, 2]);
  assert.equal(info.ack_floor.stream_seq, 2);
  assert.deepEqual([info.num_pending, info.num_ack_pending, info.num_redelivered], [1, 0, 0]);
  const restarted = spawnWorker(t, srv, "drain", "ORDERS", "order-worker", 2000);
  assert.equal(await restarted.untilLine("MSG"), 'MSG {"id":3} 1');
  assert.equal(await restarted.untilLine(""), "DONE");
  assert.equal((await restarted.exited).code, 0, restarted.stderr());
  const after = await jsm.consumers.info("ORDERS", "order-worker");
  assert.deepEqual([after.ack_floor.stream_seq, after.num_pending, after.num_ack_pending], [3, 0, 0]);
});
