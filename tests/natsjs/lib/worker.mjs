// A nats.js worker process, started by the tests (util.spawnWorker) so that it can be
// SIGKILLed as a real worker crashes: no close, no UNSUB, the socket just goes away.
//
//   node worker.mjs long-poll STREAM CONSUMER EXPIRES_MS
//       fetch() with a long expires; prints READY once its pull request is on the server.
//   node worker.mjs ack STREAM CONSUMER COUNT
//       fetches COUNT messages, acks each (confirmed by the server), prints
//       "ACKED <data> <deliveryCount>" for each and "IDLE", then stays connected.
//   node worker.mjs drain STREAM CONSUMER EXPIRES_MS
//       fetches until EXPIRES_MS passes, acks each message, prints "MSG <data> <deliveryCount>"
//       for each and "DONE", and exits.
//
// The server URL comes from KEEL_WORKER_URL.

import { connect } from "@nats-io/transport-node";
import { jetstream } from "@nats-io/jetstream";

const [mode, stream, consumer, n] = process.argv.slice(2);
const nc = await connect({ servers: process.env.KEEL_WORKER_URL, reconnect: false });
const js = jetstream(nc, { timeout: 5000 });
const c = await js.consumers.get(stream, consumer);
const say = (line) => process.stdout.write(`${line}\n`);

if (mode === "long-poll") {
  const msgs = await c.fetch({ max_messages: 5, expires: Number(n) });
  const status = msgs.status();
  const iterating = (async () => {
    for await (const m of msgs) say(`MSG ${m.string()} ${m.info.deliveryCount}`);
  })();
  // "next" is notified right after the pull request is published; the flush's PONG
  // then says the server has read it.
  for await (const s of status) {
    if (s.type === "next") break;
  }
  await nc.flush();
  say("READY");
  await iterating;
  // Stays connected until it is killed.
  await new Promise(() => {});
} else if (mode === "ack") {
  const msgs = await c.fetch({ max_messages: Number(n), expires: 5000 });
  for await (const m of msgs) {
    await m.ackAck();
    say(`ACKED ${m.string()} ${m.info.deliveryCount}`);
  }
  say("IDLE");
  await new Promise(() => {});
} else if (mode === "drain") {
  const msgs = await c.fetch({ max_messages: 100, expires: Number(n) });
  for await (const m of msgs) {
    await m.ackAck();
    say(`MSG ${m.string()} ${m.info.deliveryCount}`);
  }
  say("DONE");
  await nc.close();
} else {
  throw new Error(`unknown mode ${mode}`);
}
