import { ServerProcess } from "./lib/server.mjs";
import { connect } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const srv = await new ServerProcess().start();
try {
  const nc = await connect({ servers: srv.url });
  const jsm = await jetstreamManager(nc); const js = jetstream(nc);
  await jsm.streams.add({ name: "S", subjects: ["s.>"], storage: "memory" });
  await jsm.consumers.add("S", { durable_name: "c", ack_policy: "explicit" });
  // 1. heartbeats during consume
  const c = await js.consumers.get("S", "c");
  const msgs = await c.consume({ expires: 2000, idle_heartbeat: 1000 });
  const notes = {}; (async () => { for await (const s of msgs.status()) notes[s.type] = (notes[s.type] ?? 0) + 1; })();
  const got = []; (async () => { for await (const m of msgs) { got.push(m.string()); m.ack(); } })();
  await sleep(4500);
  await js.publish("s.a", "after");
  await sleep(300);
  console.log("consume 4.5s notes", JSON.stringify(notes), "got", got);
  // 2. stream delete + recreate while consume() runs
  await jsm.streams.delete("S");
  await sleep(500);
  await jsm.streams.add({ name: "S", subjects: ["s.>"], storage: "memory" });
  await jsm.consumers.add("S", { durable_name: "c", ack_policy: "explicit" });
  await js.publish("s.a", "recreated");
  const t0 = Date.now();
  while (!got.includes("recreated") && Date.now() - t0 < 8000) await sleep(50);
  console.log("after recreate", got, Date.now() - t0, "ms", JSON.stringify(notes));
  await msgs.close();
  // 3. fetch with max_bytes too small
  await js.publish("s.big", "x".repeat(1000));
  try { const it = await c.fetch({ max_bytes: 100, expires: 2000 }); const r = []; for await (const m of it) r.push(m.subject); console.log("max_bytes fetch", r); } catch (e) { console.log("max_bytes fetch ERR", e.message, e.code); }
  // 4. ordered consumer whose consumer gets deleted
  const oc = await js.consumers.get("S");
  const om = await oc.consume();
  const onotes = []; (async () => { for await (const s of om.status()) onotes.push(s.type); })();
  const ogot = []; (async () => { for await (const m of om) ogot.push(m.string()); })();
  await sleep(300);
  const name = (await oc.info(true)).name;
  await jsm.consumers.delete("S", name);
  await sleep(300);
  await js.publish("s.a", "o-after-delete");
  const t1 = Date.now();
  while (!ogot.includes("o-after-delete") && Date.now() - t1 < 10000) await sleep(50);
  console.log("ordered after delete", ogot, Date.now() - t1, "ms", onotes.filter(x => x !== "next").join(","));
  await om.close();
  await nc.close();
} finally { await srv.stop(); }
