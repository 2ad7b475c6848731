//! Men in the middle for the security tests: a relay that forwards every connection to a real
//! server while recording both directions (and lets a test write into a connection towards the
//! server), and a fake store that answers every connection with bytes chosen by the test and
//! records what it receives.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One relayed connection.
pub struct Conn {
    to_server: Mutex<Vec<u8>>,
    to_client: Mutex<Vec<u8>>,
    upstream: TcpStream,
    server_closed: AtomicBool,
}

impl Conn {
    /// Every byte the client sent the server so far.
    pub fn sent(&self) -> Vec<u8> {
        self.to_server.lock().unwrap().clone()
    }
    /// Every byte the server sent the client so far.
    pub fn received(&self) -> Vec<u8> {
        self.to_client.lock().unwrap().clone()
    }
    /// The address the server sees this connection come from.
    pub fn seen_as(&self) -> SocketAddr {
        self.upstream.local_addr().unwrap()
    }
    /// Writes `bytes` to the server, as if the client had sent them.
    pub fn inject(&self, bytes: &[u8]) {
        (&self.upstream).write_all(bytes).unwrap();
    }
    /// Closes the direction towards the server, as a client that stops sending.
    pub fn close_towards_server(&self) {
        let _ = self.upstream.shutdown(Shutdown::Write);
    }
    /// Waits up to `timeout` for the server to close the connection; whether it did.
    pub fn wait_server_closed(&self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while !self.server_closed.load(Ordering::SeqCst) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.server_closed.load(Ordering::SeqCst)
    }
}

/// Forwards `from` to `to`, recording into `record`, until either side ends.
fn pump(mut from: TcpStream, mut to: TcpStream, record: impl Fn(&[u8])) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        record(&buf[..n]);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A relay in front of a server; its connections in the order they were accepted.
pub struct Relay {
    addr: SocketAddr,
    conns: Arc<Mutex<Vec<Arc<Conn>>>>,
}

impl Relay {
    /// Listens on an ephemeral loopback port and relays each connection to `server`.
    pub fn start(server: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let conns: Arc<Mutex<Vec<Arc<Conn>>>> = Arc::default();
        let list = conns.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(upstream) = TcpStream::connect(server) else {
                    continue;
                };
                let conn = Arc::new(Conn {
                    to_server: Mutex::default(),
                    to_client: Mutex::default(),
                    upstream: upstream.try_clone().unwrap(),
                    server_closed: AtomicBool::new(false),
                });
                list.lock().unwrap().push(conn.clone());
                let (c2, u2, up) = (
                    client.try_clone().unwrap(),
                    upstream.try_clone().unwrap(),
                    conn.clone(),
                );
                std::thread::spawn(move || {
                    pump(client, upstream, |b| {
                        up.to_server.lock().unwrap().extend_from_slice(b)
                    })
                });
                std::thread::spawn(move || {
                    pump(u2, c2, |b| {
                        conn.to_client.lock().unwrap().extend_from_slice(b)
                    });
                    conn.server_closed.store(true, Ordering::SeqCst);
                });
            }
        });
        Relay { addr, conns }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The connections relayed so far.
    pub fn conns(&self) -> Vec<Arc<Conn>> {
        self.conns.lock().unwrap().clone()
    }
}

/// A fake store on an ephemeral loopback port: writes `reply` to every connection at once,
/// then records what it receives until the client closes (or 10 s pass). Returns its address
/// and the bytes received, one entry per connection.
pub fn fake_store(reply: Vec<u8>) -> (SocketAddr, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let received: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let record = received.clone();
    std::thread::spawn(move || {
        for mut c in listener.incoming().flatten() {
            let (reply, record) = (reply.clone(), record.clone());
            std::thread::spawn(move || {
                let slot = {
                    let mut all = record.lock().unwrap();
                    all.push(Vec::new());
                    all.len() - 1
                };
                let _ = c.write_all(&reply);
                let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = c.read(&mut buf) {
                    record.lock().unwrap()[slot].extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    (addr, received)
}
