// Issue 10 item 2 through nats.js: deleting a stream stops its consumers, so a stream and
// consumer created again under the same names answer alone (no ghost replies).

import { test } from "node:test";
import assert from "node:assert/strict";

import { AckPolicy, StorageType } from "@nats-io/jetstream";

import { startServer } from "./lib/server.mjs";
import { describeMsg, notified, rawPull, setup, waitInfo } from "./lib/util.mjs";

const QUIET_MS = 300; // how long "nothing else arrives" is watched

async function create(jsm) {
  await jsm.streams.add({ name: "D", subjects: ["d.>"], storage: StorageType.Memory });
  await jsm.consumers.add("D", { durable_name: "dur", ack_policy: AckPolicy.Explicit });
}

test("stream delete then recreate: no ghost replies to a no_wait fetch", async (t) => {
  const srv = await startServer(t);
  const { nc, js, jsm } = await setup(t, srv);
  await create(jsm);

  // A consume() waiting on the consumer is told it was deleted with the stream.
  const c = await js.consumers.get("D", "dur");
  const msgs = await c.consume({ expires: 30_000 });
  const status = msgs.status();
  const loop = (async () => {
    for await (const m of msgs) assert.fail(`consume() got ${m.string()}`);
  })();
  await waitInfo(jsm, "D", "dur", "consume() waiting", (i) => i.num_waiting === 1);
  assert.equal(await jsm.streams.delete("D"), true);
  const deleted = await notified(status, "consumer_deleted");
  assert.equal(deleted.code, 409);
  assert.equal(deleted.description, "consumer deleted"); // nats.js lowercases it
  await msgs.close();
  await loop;

  // A pull on the old names: one answer only, no responders (nothing listens any more).
  const ghost = await rawPull(nc, "D", "dur", { batch: 1, no_wait: true });
  assert.deepEqual(describeMsg(await ghost.next()), { status: 503, description: "" });
  assert.equal(await ghost.next(QUIET_MS), null, "a second reply to a pull on a deleted stream");

  await create(jsm);
  await js.publish("d.x", "fresh");
  await waitInfo(jsm, "D", "dur", "num_pending 1", (i) => i.num_pending === 1);
  const pull = await rawPull(nc, "D", "dur", { batch: 1, no_wait: true });
  const first = describeMsg(await pull.next());
  assert.deepEqual([first.data, first.deliveries], ["fresh", 1], `got ${JSON.stringify(first)}`);
  const extra = await pull.next(QUIET_MS);
  assert.equal(extra, null, `a ghost reply: ${extra && JSON.stringify(describeMsg(extra))}`);

  // nats.js's own fetch on the recreated consumer: nothing left, ends cleanly.
  const again = await (await js.consumers.get("D", "dur")).fetch({ max_messages: 1, expires: 1000 });
  for await (const m of again) assert.fail(`fetch got ${m.string()}`);
});
