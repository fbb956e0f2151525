// Issue 10 item 4 through nats.js: the JetStream advisories a dead-letter queue is built on,
// read with jsm.advisories() (a subscription to $JS.EVENT.ADVISORY.>).

import { test } from "node:test";
import assert from "node:assert/strict";

import { AckPolicy, AdvisoryKind, StorageType } from "@nats-io/jetstream";

import { startServer } from "./lib/server.mjs";
import { SEC_NS, setup, STEP_MS } from "./lib/util.mjs";

/** Collects advisories from jsm.advisories(); `until(pred)` waits for a matching one. */
async function advisories(nc, jsm) {
  const seen = [];
  let wake = null;
  const iter = jsm.advisories();
  (async () => {
    for await (const a of iter) {
      seen.push(a);
      wake?.();
    }
  })();
  await nc.flush(); // the subscription is on the server before anything happens
  return {
    seen,
    async until(what, pred, ms = STEP_MS) {
      const deadline = Date.now() + ms;
      for (;;) {
        const hit = seen.find(pred);
        if (hit) return hit;
        const left = deadline - Date.now();
        if (left <= 0) {
          throw new Error(`no ${what} advisory within ${ms} ms; seen: ${JSON.stringify(seen.map((a) => a.data))}`);
        }
        await new Promise((ok) => {
          const timer = setTimeout(ok, left);
          wake = () => {
            clearTimeout(timer);
            ok();
          };
        });
        wake = null;
      }
    },
  };
}

const TYPE = "io.nats.jetstream.advisory.v1.";

const HEAD = ["type", "id", "timestamp", "stream", "consumer"];
const DELIVERY = [...HEAD, "consumer_seq", "stream_seq", "deliveries"];
// The reference's fields, in its order.
const FIELDS = {
  consumer_action: [...HEAD, "action"],
  nak: DELIVERY,
  terminated: [...DELIVERY, "reason"],
  max_deliver: [...HEAD, "stream_seq", "deliveries"],
};

/** Fields of an advisory: type, id, timestamp, stream and consumer, then its own. */
function checkHead(a, kind, consumer = "C") {
  assert.deepEqual(Object.keys(a.data), FIELDS[kind], `${kind}: ${JSON.stringify(a.data)}`);
  assert.equal(a.kind, kind);
  assert.equal(a.data.type, TYPE + kind);
  assert.equal(typeof a.data.id, "string");
  assert.ok(a.data.id.length > 0);
  assert.ok(!Number.isNaN(Date.parse(a.data.timestamp)), `timestamp ${a.data.timestamp}`);
  assert.equal(a.data.stream, "ADV");
  assert.equal(a.data.consumer, consumer);
}

test("advisories: consumer created/deleted, MSG_NAKED, MSG_TERMINATED, MAX_DELIVERIES", async (t) => {
  const srv = await startServer(t);
  const { nc, js, jsm } = await setup(t, srv);
  const adv = await advisories(nc, jsm);
  await jsm.streams.add({ name: "ADV", subjects: ["adv.>"], storage: StorageType.Memory });
  await jsm.consumers.add("ADV", {
    durable_name: "C",
    ack_policy: AckPolicy.Explicit,
    max_deliver: 2,
    ack_wait: SEC_NS,
  });
  const created = await adv.until("consumer created", (a) => a.kind === AdvisoryKind.ConsumerAction);
  checkHead(created, "consumer_action");
  assert.equal(created.data.action, "create");

  for (const s of ["adv.1", "adv.2", "adv.3"]) await js.publish(s, s);
  const c = await js.consumers.get("ADV", "C");
  const first = [];
  for await (const m of await c.fetch({ max_messages: 3, expires: STEP_MS })) first.push(m);
  assert.deepEqual(first.map((m) => m.subject), ["adv.1", "adv.2", "adv.3"]);
  const [m1, m2, m3] = first;
  await m1.ackAck();
  m3.term("bad payload");
  m2.nak();
  await nc.flush();

  const naked = await adv.until("MSG_NAKED", (a) => a.kind === "nak");
  checkHead(naked, "nak");
  assert.deepEqual([naked.data.stream_seq, naked.data.consumer_seq, naked.data.deliveries], [2, 2, 1]);
  const term = await adv.until("MSG_TERMINATED", (a) => a.kind === AdvisoryKind.Terminated);
  checkHead(term, "terminated");
  assert.deepEqual([term.data.stream_seq, term.data.consumer_seq, term.data.deliveries], [3, 3, 1]);
  assert.equal(term.data.reason, "bad payload");

  // The second and last delivery of message 2 is never acked. A consume() keeps a request
  // waiting: nats-server 2.15.1 notices the exhausted message when it would send it again.
  const second = await c.next({ expires: STEP_MS });
  assert.equal(second?.subject, "adv.2");
  assert.equal(second.info.deliveryCount, 2);
  const msgs = await c.consume({ expires: 10_000 });
  const loop = (async () => {
    for await (const m of msgs) assert.fail(`delivered again: ${m.subject} (${m.info.deliveryCount})`);
  })();
  const max = await adv.until("MAX_DELIVERIES", (a) => a.kind === AdvisoryKind.MaxDeliver);
  checkHead(max, "max_deliver");
  assert.deepEqual([max.data.stream_seq, max.data.deliveries], [2, 2]);
  await msgs.close();
  await loop;

  await jsm.consumers.delete("ADV", "C");
  const deleted = await adv.until(
    "consumer deleted",
    (a) => a.kind === AdvisoryKind.ConsumerAction && a.data.action === "delete",
  );
  checkHead(deleted, "consumer_action");

  // Subjects: the iterator does not show them, so check them on a plain subscription too.
  const subjects = [];
  nc.subscribe("$JS.EVENT.ADVISORY.CONSUMER.>", { callback: (_e, m) => subjects.push(m.subject) });
  await nc.flush();
  await jsm.consumers.add("ADV", { durable_name: "D", ack_policy: AckPolicy.Explicit });
  await jsm.consumers.delete("ADV", "D");
  await adv.until("consumer D deleted", (a) => a.data.consumer === "D" && a.data.action === "delete");
  await nc.flush();
  assert.deepEqual(subjects, [
    "$JS.EVENT.ADVISORY.CONSUMER.CREATED.ADV.D",
    "$JS.EVENT.ADVISORY.CONSUMER.DELETED.ADV.D",
  ]);
});
