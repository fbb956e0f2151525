// Issue 10 item 3 through nats.js: connecting (the INFO fields clients read), JetStream
// requests with null in optional fields as a JavaScript program passes them, and ordered
// consumers, whose num_replicas 1 must be echoed as given.

import { test } from "node:test";
import assert from "node:assert/strict";

import { Feature } from "@nats-io/transport-node";
import { AckPolicy, StorageType } from "@nats-io/jetstream";
import { Kvm } from "@nats-io/kv";

import { startServer } from "./lib/server.mjs";
import { setup } from "./lib/util.mjs";

test("connect: INFO has the fields nats.js and the other clients read", async (t) => {
  const srv = await startServer(t);
  const { nc } = await setup(t, srv);
  const info = nc.info;
  for (const key of ["server_id", "server_name", "version", "go", "git_commit", "host"]) {
    assert.equal(typeof info[key], "string", `INFO ${key}: ${JSON.stringify(info)}`);
    assert.ok(info[key].length > 0, `INFO ${key} empty`);
  }
  assert.equal(info.proto, 1);
  assert.equal(info.headers, true);
  assert.equal(info.jetstream, true);
  assert.equal(info.max_payload, 1024 * 1024);
  assert.equal(typeof info.api_lvl, "number");
  assert.ok(info.api_lvl >= 1, `api_lvl ${info.api_lvl}`);
  // nats.js gates JetStream features on the version: these need 2.11.
  assert.equal(nc.features.supports(Feature.JS_PRIORITY_GROUPS), true, info.version);
  assert.equal(nc.features.supports(Feature.JS_BATCH_DIRECT_GET), true, info.version);
  const rtt = await nc.rtt();
  assert.ok(rtt >= 0);
});

test("JetStream requests with null in optional fields", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  const account = await jsm.getAccountInfo();
  assert.equal(typeof account.streams, "number");

  const si = await jsm.streams.add({
    name: "S",
    subjects: ["s.>"],
    storage: StorageType.Memory,
    description: null,
    max_msgs: null,
    max_bytes: null,
    max_age: null,
    duplicate_window: null,
    placement: null,
    republish: null,
    subject_transform: null,
    metadata: null,
  });
  assert.equal(si.config.description, undefined);
  assert.deepEqual([si.config.max_msgs, si.config.max_bytes, si.config.max_age], [-1, -1, 0]);
  assert.equal(si.config.duplicate_window, 120 * 1_000_000_000);
  assert.equal((await js.publish("s.a", "one")).seq, 1);
  assert.equal((await js.publish("s.b", "two")).seq, 2);

  const info = await jsm.streams.info("S", { deleted_details: false, subjects_filter: null, offset: null });
  assert.equal(info.state.messages, 2);
  const bySeq = await jsm.streams.getMessage("S", { seq: 1, last_by_subj: null });
  assert.equal(bySeq.string(), "one");
  const bySubject = await jsm.streams.getMessage("S", { last_by_subj: "s.b", seq: null });
  assert.deepEqual([bySubject.seq, bySubject.string()], [2, "two"]);

  const ci = await jsm.consumers.add("S", {
    durable_name: "d",
    ack_policy: AckPolicy.Explicit,
    description: null,
    filter_subject: null,
    max_deliver: null,
    ack_wait: null,
    backoff: null,
    max_waiting: null,
    inactive_threshold: null,
    metadata: null,
  });
  assert.deepEqual(
    [ci.config.max_deliver, ci.config.ack_wait, ci.config.max_waiting, ci.num_pending],
    [-1, 30 * 1_000_000_000, 512, 2],
  );
  const m = await (await js.consumers.get("S", "d")).next({ expires: 5000 });
  assert.equal(m?.string(), "one");
  await m.ackAck();

  const purged = await jsm.streams.purge("S", { filter: null, keep: null, seq: null });
  assert.deepEqual([purged.success, purged.purged], [true, 2]);
  assert.deepEqual(
    (await jsm.streams.list().next()).map((s) => s.config.name),
    ["S"],
  );

  const kv = await new Kvm(js).create("B");
  await kv.put("k", "v");
  assert.equal((await kv.get("k")).string(), "v");
  assert.equal(await kv.get("missing"), null);
});

test("ordered consumers: num_replicas 1 is echoed, messages arrive in order", async (t) => {
  const srv = await startServer(t);
  const { js, jsm } = await setup(t, srv);
  await jsm.streams.add({ name: "O", subjects: ["o.>"], storage: StorageType.Memory });
  for (let n = 1; n <= 3; n++) await js.publish(`o.${n}`, `m${n}`);

  // Pull-based ordered consumer (js.consumers.get with no name).
  const oc = await js.consumers.get("O");
  const info = await oc.info();
  assert.equal(info.config.num_replicas, 1, JSON.stringify(info.config));
  assert.equal(info.config.mem_storage, true);
  assert.equal(info.config.ack_policy, "none");
  const got = [];
  for await (const m of await oc.fetch({ max_messages: 3, expires: 5000 })) got.push(m.string());
  assert.deepEqual(got, ["m1", "m2", "m3"]);

  // Push-based ordered consumer.
  const pc = await js.consumers.getPushConsumer("O");
  const pinfo = await pc.info();
  assert.equal(pinfo.config.num_replicas, 1, JSON.stringify(pinfo.config));
  assert.equal(pinfo.config.flow_control, true);
  const pushed = [];
  const msgs = await pc.consume();
  for await (const m of msgs) {
    pushed.push(m.string());
    if (pushed.length === 3) break;
  }
  assert.deepEqual(pushed, ["m1", "m2", "m3"]);
});
