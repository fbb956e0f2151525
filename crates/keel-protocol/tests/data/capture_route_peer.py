# Regenerates the fixtures beside it (ids, nonces and ports change each run; the tests read
# them from the file).
# Capture what a real nats-server 2.15.1 sends to a no-pool route peer (a raw socket) while a
# client, a leaf node and a third server come and go.
import socket, subprocess, time, sys, os, tempfile, json
NS = os.environ.get("NATS_SERVER", "nats-server")
HERE = os.path.dirname(os.path.abspath(__file__))
TMP = tempfile.mkdtemp()
CONF_A, CONF_L = os.path.join(TMP, "a.conf"), os.path.join(TMP, "leaf.conf")
def free():
    s=socket.socket(); s.bind(("127.0.0.1",0)); p=s.getsockname()[1]; s.close(); return p
procs=[]
def start(args):
    p=subprocess.Popen([NS]+args,stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL); procs.append(p); return p
def dial(port, tries=300):
    for _ in range(tries):
        try: return socket.create_connection(("127.0.0.1",port))
        except OSError: time.sleep(0.05)
    raise SystemExit("no server on %d"%port)
got=bytearray()
def drain(s, secs):
    s.settimeout(0.05); end=time.time()+secs
    while time.time()<end:
        try:
            b=s.recv(65536)
            if not b: break
            got.extend(b)
        except socket.timeout: pass
ca, ra, la = free(), free(), free()
# A accepts routes and leaf nodes
open(CONF_A,"w").write(f'port: {ca}\nhost: 127.0.0.1\nserver_name: A\ncluster {{ name: ref, listen: "127.0.0.1:{ra}" }}\nleafnodes {{ listen: "127.0.0.1:{la}" }}\n')
start(["-c",CONF_A])
fid = "NFAKEPEERFAKEPEERFAKEPEERFAKEPEERFAKEPEERFAKEPEERFAKEPE"[:56]
f = dial(ra)
sent = bytearray()
def fsend(b):
    sent.extend(b); f.sendall(b)
fsend(b'CONNECT {"echo":true,"verbose":false,"pedantic":false,"tls_required":false,"headers":true,"name":"%s","cluster":"ref","lnoc":true}\r\n' % fid.encode())
drain(f, 0.5)
fport = free()
fsend(b'INFO {"server_id":"%s","server_name":"F","version":"2.15.1","proto":3,"go":"go1.27.2","host":"127.0.0.1","port":%d,"headers":true,"max_payload":1048576,"cluster":"ref","lnoc":true,"lnocu":true} \r\n' % (fid.encode(), fport))
drain(f, 1.0)
# a client on A with plain and queue subs
c = dial(ca); c.settimeout(2); c.recv(4096)
c.sendall(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\nSUB foo 1\r\nSUB work workers 2\r\nSUB work workers 3\r\nSUB mix g1 4\r\nPING\r\n')
drain(f, 0.5)
# the peer announces interest and publishes into A
fsend(b'RS+ $G bar\r\nRS+ $G bq grp 1\r\nRS+ $G bq grp 2\r\nPING\r\n')
drain(f, 0.5)
c.sendall(b'PUB bar 5\r\nhello\r\nPUB bar r.1 2\r\nhi\r\nHPUB bar r.2 20 22\r\nNATS/1.0\r\nX-K: v\r\n\r\nhi\r\nPUB bq 1\r\nq\r\nPUB bq rq.1 1\r\ny\r\nHPUB bq 12 12\r\nNATS/1.0\r\n\r\n\r\nUNSUB 1\r\nPING\r\n')
drain(f, 0.8)
# a leaf node joins A, subscribes and publishes
lc = free()
open(CONF_L,"w").write(f'port: {lc}\nhost: 127.0.0.1\nserver_name: L\ncluster {{ name: leafc, listen: "127.0.0.1:-1" }}\nleafnodes {{ remotes: [ {{ url: "nats-leaf://127.0.0.1:{la}" }} ] }}\n')
start(["-c",CONF_L])
l = dial(lc); l.settimeout(2); l.recv(4096)
l.sendall(b'CONNECT {"verbose":false,"headers":true}\r\nSUB leafsub 1\r\nSUB leafq lg 2\r\nPING\r\n')
drain(f, 2.5)
l.sendall(b'PUB bar 1\r\nc\r\nPUB bq rr 1\r\nd\r\nHPUB bar 12 14\r\nNATS/1.0\r\n\r\nhi\r\nPING\r\n')
drain(f, 1.0)
l.sendall(b'UNSUB 1\r\nUNSUB 2\r\nPING\r\n')
drain(f, 1.0)
# a third server joins through A: A gossips it to the peer
cc, rc = free(), free()
start(["-a","127.0.0.1","-p",str(cc),"-n","C","--cluster",f"nats://127.0.0.1:{rc}","--cluster_name","ref","--routes",f"nats://127.0.0.1:{ra}"])
drain(f, 2.5)
fsend(b'PONG\r\n')
drain(f, 0.5)
open(os.path.join(HERE,"ref-2.15.1-a-to-peer.bin"),"wb").write(bytes(got))
open(os.path.join(HERE,"peer-to-ref-a.bin"),"wb").write(bytes(sent))
for p in procs: p.terminate()
for p in procs: p.wait()
print(len(got), "bytes from A")
