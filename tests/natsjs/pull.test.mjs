// Issue 10 item 5 through nats.js: pull request validation (heartbeat over half of
// expires), no_wait with expires, a new push / ordered consumer delivering at once (KV
// watchers), priority groups through fetch()/consume() options, and consumer pause and
// resume through the JetStream manager.

import { test } from "node:test";
import assert from "node:assert/strict";

import { AckPolicy, StorageType } from "@nats-io/jetstream";
import { Kvm } from "@nats-io/kv";

import { startServer } from "./lib/server.mjs";
import { describeMsg, notified, rawPull, SEC_NS, setup, sleep, STEP_MS, waitInfo } from "./lib/util.mjs";

const QUIET_MS = 300; // how long "nothing arrives" is watched

async function stream(jsm, name, consumer) {
  await jsm.streams.add({ name, subjects: [`${name.toLowerCase()}.>`], storage: StorageType.Memory });
  if (consumer) {
    await jsm.consumers.add(name, { durable_name: "c", ack_policy: AckPolicy.Explicit, ...consumer });
  }
}

/** Drains a fetch()/consume() iterator; returns [messages, error]. */
async function drain(iter, limit = Infinity) {
  const got = [];
  try {
    for await (const m of iter) {
      got.push(m);
      if (got.length >= limit) break;
    }
    return [got, null];
  } catch (err) {
    return [got, err];
  }
}

test("pull heartbeat over half of expires: 400 through fetch() and consume()", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await stream(jsm, "H", {});
  const c = await js.consumers.get("H", "c");
  for (const start of [(o) => c.fetch(o), (o) => c.consume(o)]) {
    const [got, err] = await drain(await start({ max_messages: 1, expires: 2000, idle_heartbeat: 1500 }));
    assert.equal(got.length, 0);
    assert.ok(err, "no error for a heartbeat over half of expires");
    assert.equal(err.code, 400);
    assert.match(err.message, /heartbeat value too large/i);
  }
  // Exactly half (nats.js's default): heartbeats, then the request ends normally.
  const msgs = await c.fetch({ max_messages: 1, expires: 2000, idle_heartbeat: 1000 });
  const status = msgs.status();
  const heartbeats = (async () => {
    let n = 0;
    for await (const s of status) if (s.type === "heartbeat") n++;
    return n;
  })();
  const [got, err] = await drain(msgs);
  assert.deepEqual([got.length, err], [0, null]);
  assert.ok((await heartbeats) >= 1, "no idle heartbeat");
});

test("no_wait with expires waits up to expires; without expires answers 404 at once", async (t) => {
  const srv = await startServer(t);
  const { nc, js, jsm } = await setup(t, srv);
  await stream(jsm, "N", {});
  const started = Date.now();
  const empty = await rawPull(nc, "N", "c", { batch: 2, no_wait: true, expires: SEC_NS });
  assert.deepEqual(describeMsg(await empty.next()), { status: 408, description: "Request Timeout" });
  assert.ok(Date.now() - started >= 900, `timed out after ${Date.now() - started} ms`);

  const late = await rawPull(nc, "N", "c", { batch: 2, no_wait: true, expires: 5 * SEC_NS });
  await waitInfo(jsm, "N", "c", "no_wait request waiting", (i) => i.num_waiting === 1);
  await js.publish("n.x", "late");
  const m = describeMsg(await late.next());
  assert.deepEqual([m.data, m.deliveries], ["late", 1]);
  assert.deepEqual(describeMsg(await late.next()), { status: 404, description: "No Messages" });

  const now = await rawPull(nc, "N", "c", { batch: 1, no_wait: true });
  assert.deepEqual(describeMsg(await now.next()), { status: 404, description: "No Messages" });
});

test("new KV watchers and ordered push consumers see existing values at once", async (t) => {
  const srv = await startServer(t);
  const { js } = await setup(t, srv);
  const kv = await new Kvm(js).create("W", { storage: StorageType.Memory });
  await kv.put("color", "blue");
  const N = 20;
  // A poll delay before the first delivery (100 ms each, as Keel had) would take 2 s here;
  // the bound is loose for a loaded machine.
  const started = Date.now();
  for (let n = 0; n < N; n++) {
    const w = await kv.watch({ key: "color" });
    for await (const e of w) {
      assert.deepEqual([e.key, e.string()], ["color", "blue"]);
      break;
    }
    w.stop();
  }
  const watchers = Date.now() - started;
  const started2 = Date.now();
  for (let n = 0; n < N; n++) {
    const pc = await js.consumers.getPushConsumer("KV_W");
    const msgs = await pc.consume();
    for await (const m of msgs) {
      assert.equal(m.string(), "blue");
      break;
    }
    await msgs.close();
  }
  const ordered = Date.now() - started2;
  assert.ok(watchers < 1500 && ordered < 1500, `${N} first deliveries took ${watchers} ms / ${ordered} ms`);
});

test("priority groups: overflow with min_pending through fetch()", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await stream(jsm, "O", { priority_policy: "overflow", priority_groups: ["A"] });
  const c = await js.consumers.get("O", "c");
  await js.publish("o.x", "1");
  const overflow = await c.fetch({ max_messages: 10, expires: 10_000, group: "A", min_pending: 3 });
  const got = [];
  const loop = (async () => {
    for await (const m of overflow) {
      got.push(m.string());
      m.ack();
    }
  })();
  await waitInfo(jsm, "O", "c", "overflow request waiting", (i) => i.num_waiting === 1);
  await js.publish("o.x", "2");
  await sleep(QUIET_MS);
  assert.deepEqual(got, [], "served with fewer than min_pending pending");
  await js.publish("o.x", "3");
  // Served while at least three are pending: message 1 only.
  await waitInfo(jsm, "O", "c", "one delivered", (i) => i.delivered.consumer_seq === 1);
  await sleep(QUIET_MS);
  assert.deepEqual(got, ["1"]);
  // A normal member of the group takes the rest.
  const [rest] = await drain(await c.fetch({ max_messages: 2, expires: 5000, group: "A" }));
  assert.deepEqual(rest.map((m) => m.string()), ["2", "3"]);
  await overflow.close();
  await loop;
  // No group for a priority consumer: refused.
  const [none, err] = await drain(await c.fetch({ max_messages: 1, expires: 2000 }));
  assert.equal(none.length, 0);
  assert.equal(err?.code, 400);
  assert.match(err.message, /priority group missing/i);
});

test("priority groups: pinned_client through consume() and jsm.consumers.unpin()", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await stream(jsm, "Q", { priority_policy: "pinned_client", priority_groups: ["A"] });
  const ci = await jsm.consumers.info("Q", "c");
  assert.deepEqual(ci.config.priority_groups, ["A"]);
  assert.equal(ci.config.priority_policy, "pinned_client");
  for (let n = 1; n <= 2; n++) await js.publish("q.x", String(n));

  // The first consume() is pinned: its messages carry the pin id, which it sends back.
  const c = await js.consumers.get("Q", "c");
  const first = await c.consume({ max_messages: 1, expires: 5000, group: "A" });
  const firstStatus = first.status();
  const pinned = notified(firstStatus, "consumer_pinned");
  const firstGot = [];
  const firstLoop = (async () => {
    for await (const m of first) {
      firstGot.push([m.string(), m.headers?.get("Nats-Pin-Id")]);
      m.ack();
    }
  })();
  const pin = (await pinned).id;
  assert.ok(pin, "no pin id");
  const delivered = (n) => (i) => i.delivered.consumer_seq === n && i.num_ack_pending === 0;
  await waitInfo(jsm, "Q", "c", "both delivered to the pinned client", delivered(2));
  assert.deepEqual(firstGot, [["1", pin], ["2", pin]]);
  assert.equal((await jsm.consumers.info("Q", "c")).priority_groups[0].pinned_client_id, pin);

  // Another client waits while the pin is held: the next message goes to the pinned one.
  const other = await (await js.consumers.get("Q", "c")).fetch({ max_messages: 1, expires: 10_000, group: "A" });
  const otherDone = drain(other);
  await waitInfo(jsm, "Q", "c", "both clients waiting", (i) => i.num_waiting === 2);
  await js.publish("q.x", "3");
  await waitInfo(jsm, "Q", "c", "3 delivered", delivered(3));
  assert.deepEqual(firstGot[2], ["3", pin]);

  // Unpinned (and the pinned client gone): the waiting client gets the next one, with a new pin.
  await first.close();
  await firstLoop;
  await jsm.consumers.unpin("Q", "c", "A");
  await js.publish("q.x", "4");
  const [otherGot, err] = await otherDone;
  assert.equal(err, null);
  assert.deepEqual(otherGot.map((m) => m.string()), ["4"]);
  const newPin = otherGot[0].headers?.get("Nats-Pin-Id");
  assert.ok(newPin && newPin !== pin, `new pin ${newPin} (old ${pin})`);
});

test("priority groups: prioritized serves lower priority numbers first", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await stream(jsm, "R", { priority_policy: "prioritized", priority_groups: ["A"] });
  const low = await (await js.consumers.get("R", "c")).fetch({ max_messages: 2, expires: 10_000, group: "A", priority: 5 });
  const lowDone = drain(low, 1);
  await waitInfo(jsm, "R", "c", "low priority waiting", (i) => i.num_waiting === 1);
  const high = await (await js.consumers.get("R", "c")).fetch({ max_messages: 2, expires: 10_000, group: "A", priority: 1 });
  const highDone = drain(high, 2);
  await waitInfo(jsm, "R", "c", "both waiting", (i) => i.num_waiting === 2);
  for (let n = 1; n <= 3; n++) await js.publish("r.x", String(n));
  const [highGot] = await highDone;
  const [lowGot] = await lowDone;
  assert.deepEqual(highGot.map((m) => m.string()), ["1", "2"]);
  assert.deepEqual(lowGot.map((m) => m.string()), ["3"]);
  await low.close();
});

test("consumer pause and resume through jsm.consumers", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await stream(jsm, "P", {});
  await js.publish("p.x", "held");
  const until = new Date(Date.now() + 3600_000);
  const paused = await jsm.consumers.pause("P", "c", until);
  assert.equal(paused.paused, true);
  assert.equal(Date.parse(paused.pause_until), Math.floor(until.getTime()));
  const info = await jsm.consumers.info("P", "c");
  assert.equal(info.paused, true);
  assert.ok(info.pause_remaining > 0);
  assert.equal(Date.parse(info.config.pause_until), until.getTime());

  // Paused: a fetch gets nothing and ends when it expires.
  const c = await js.consumers.get("P", "c");
  const [none, err] = await drain(await c.fetch({ max_messages: 1, expires: 1000 }));
  assert.deepEqual([none.length, err], [0, null]);

  // nats.js resumes with the epoch (1970-01-01T00:00:00.000Z).
  const resumed = await jsm.consumers.resume("P", "c");
  assert.equal(resumed.paused, false);
  assert.ok(!(await jsm.consumers.info("P", "c")).paused);
  const m = await c.next({ expires: STEP_MS });
  assert.deepEqual([m?.string(), m?.info.deliveryCount], ["held", 1]);

  // A consumer created paused (pause_until in its config) holds its messages until then.
  const soon = new Date(Date.now() + 2000);
  const ci = await jsm.consumers.add("P", {
    durable_name: "later",
    ack_policy: AckPolicy.Explicit,
    pause_until: soon.toISOString(),
  });
  assert.equal(ci.paused, true);
  const later = await js.consumers.get("P", "later");
  const got = await later.next({ expires: 10_000 });
  assert.equal(got?.string(), "held");
  assert.ok(Date.now() >= soon.getTime() - 50, "delivered before pause_until");
});
