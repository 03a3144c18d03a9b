//! DASR between real processes on 127.0.0.1: a receiver and senders, each a separate process
//! running the `dasr_peer` example's code (this test binary re-executed with
//! `DRUM_DASR_PEER_ARGS` set, so the test needs no other build step). Caps are read from the
//! JSON lines the peers print. Every wait has a deadline; every child is killed by a Drop guard.
//! Convergence times are printed (`--nocapture`), not asserted.

#[path = "../examples/dasr_peer.rs"]
#[allow(dead_code)]
mod dasr_peer;

use drum_common::dasr::{Ack, Announce, Datagram, Phase};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CHILD_ENV: &str = "DRUM_DASR_PEER_ARGS";
const WAIT: Duration = Duration::from_secs(10);
const R: f64 = 1000.0;

/// Not a test of its own: the entry point of the peer processes the other tests start.
#[test]
fn dasr_peer_child() {
    let Ok(args) = std::env::var(CHILD_ENV) else {
        return;
    };
    let args: Vec<String> = serde_json::from_str(&args).expect("peer args are a JSON array");
    let code = match dasr_peer::run(args, Box::new(std::io::stderr())) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("dasr_peer failed: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

struct Peer {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<Value>,
    other: Vec<String>,
    cursor: usize,
}

impl Peer {
    fn spawn(name: &str, args: &[String]) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "dasr_peer_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, serde_json::to_string(args).unwrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning a peer process");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer {
            name: name.into(),
            stdin: child.stdin.take(),
            child,
            lines: rx,
            seen: Vec::new(),
            other: Vec::new(),
            cursor: 0,
        }
    }

    fn history(&self) -> String {
        let mut s = String::new();
        for v in &self.seen {
            s.push_str(&format!("  {v}\n"));
        }
        for l in &self.other {
            s.push_str(&format!("  (non-JSON) {l}\n"));
        }
        s
    }

    /// The first line from the current position on (or arriving before the deadline) that
    /// satisfies `pred`; the position moves past it.
    fn wait_for(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            while self.cursor < self.seen.len() {
                let v = &self.seen[self.cursor];
                self.cursor += 1;
                if pred(v) {
                    return v.clone();
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => match serde_json::from_str::<Value>(&l) {
                    Ok(v) if v.is_object() => self.seen.push(v),
                    _ => self.other.push(l),
                },
                Err(_) => panic!(
                    "{}: no {what} within {WAIT:?}; it printed:\n{}",
                    self.name,
                    self.history()
                ),
            }
        }
    }

    /// Takes in every line printed so far without waiting.
    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            match serde_json::from_str::<Value>(&l) {
                Ok(v) if v.is_object() => self.seen.push(v),
                _ => self.other.push(l),
            }
        }
    }

    fn addr(&mut self) -> SocketAddr {
        let v = self.wait_for("listening line", |v| v["event"] == "listening");
        v["addr"].as_str().unwrap().parse().unwrap()
    }

    fn close_stdin(&mut self) {
        self.stdin.take();
    }

    fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn sender(name: &str, to: SocketAddr, msg: u64, extra: &[&str]) -> Peer {
    let mut a = args(&["--send-to", &to.to_string(), "--msg-id", &msg.to_string()]);
    a.extend(args(extra));
    Peer::spawn(name, &a)
}

fn is_cap(v: &Value, dest: SocketAddr, cap: f64) -> bool {
    v["event"] == "cap"
        && v["dest"] == dest.to_string()
        && v["cap"].as_f64().is_some_and(|c| (c - cap).abs() < 1e-9)
}

fn t_us(v: &Value) -> u64 {
    v["t_us"].as_u64().unwrap()
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

#[test]
fn second_sender_halves_both_caps_and_its_end_restores_r() {
    let mut rx = Peer::spawn("receiver", &args(&["--rate", "1000"]));
    let raddr = rx.addr();
    let mut a = sender("A", raddr, 1, &[]);
    a.wait_for("cap R", |v| is_cap(v, raddr, R));

    let mut b = sender("B", raddr, 2, &[]);
    let start = b.wait_for("start", |v| v["event"] == "start");
    let b_cap = b.wait_for("cap R/2", |v| is_cap(v, raddr, R / 2.0));
    let a_cap = a.wait_for("cap R/2", |v| is_cap(v, raddr, R / 2.0));
    assert_eq!(
        (a_cap["n"].as_u64(), b_cap["n"].as_u64()),
        (Some(2), Some(2))
    );
    // A's new cap is the push of the very epoch B's START created (not a later refresh).
    assert_eq!(a_cap["epoch"], b_cap["epoch"]);
    let to_a = t_us(&a_cap) as i64 - t_us(&start) as i64;
    let to_b = t_us(&b_cap) as i64 - t_us(&start) as i64;
    println!(
        "DASR convergence: B START -> A cap R/2 in {to_a} us (push); B START -> B cap R/2 in \
         {to_b} us (its own ACK, one control round trip)"
    );

    b.close_stdin();
    let end = b.wait_for("end", |v| v["event"] == "end");
    let back = a.wait_for("cap R again", |v| is_cap(v, raddr, R));
    assert_eq!(back["n"].as_u64(), Some(1));
    assert!(back["epoch"].as_u64() > a_cap["epoch"].as_u64());
    println!(
        "DASR recovery: B END -> A cap R in {} us",
        t_us(&back) as i64 - t_us(&end) as i64
    );
    let b_none = b.wait_for("no cap after its end", |v| {
        v["event"] == "cap" && v["cap"].is_null()
    });
    assert!(t_us(&b_none) >= t_us(&end));
    rx.wait_for("receiver counters", |v| {
        v["event"] == "metrics" && v["starts"] == 2 && v["ends"] == 1 && v["members"] == 1
    });
}

#[test]
fn sender_killed_mid_message_expires_and_the_other_gets_r_back() {
    let expiry = ["--expiry-ms", "300"];
    let mut rx = Peer::spawn("receiver", &args(&["--rate", "1000", "--expiry-ms", "300"]));
    let raddr = rx.addr();
    let mut a = sender("A", raddr, 1, &expiry);
    a.wait_for("cap R", |v| is_cap(v, raddr, R));
    let mut b = sender("B", raddr, 1, &expiry);
    b.wait_for("cap R/2", |v| is_cap(v, raddr, R / 2.0));
    a.wait_for("cap R/2", |v| is_cap(v, raddr, R / 2.0));
    let killed = now_us();
    b.kill();
    let back = a.wait_for("cap R after B's expiry", |v| is_cap(v, raddr, R));
    let after = t_us(&back) as i64 - killed as i64;
    println!(
        "DASR expiry: B SIGKILLed -> A cap R in {} ms (expiry 300 ms, refresh 75 ms)",
        after / 1000
    );
    // B's last refresh was at most 75 ms before the kill, so the expiry cannot come sooner.
    assert!(
        after >= 200_000,
        "A got R back {after} us after the kill: not by expiry"
    );
    rx.wait_for("an expiry counted", |v| {
        v["event"] == "metrics" && v["expiries"] == 1 && v["members"] == 1
    });
    // A keeps refreshing: long after the expiry timeout it still has cap R, nothing else.
    std::thread::sleep(Duration::from_millis(700));
    a.drain();
    let caps: Vec<&Value> = a.seen[a.cursor..]
        .iter()
        .filter(|v| v["event"] == "cap")
        .collect();
    assert!(caps.is_empty(), "A's cap changed again: {caps:?}");
}

#[test]
fn garbage_is_counted_and_ignored_while_real_senders_work() {
    let mut rx = Peer::spawn("receiver", &args(&["--rate", "1000"]));
    let raddr = rx.addr();
    let mut a = sender("A", raddr, 1, &[]);
    a.wait_for("cap R", |v| is_cap(v, raddr, R));

    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(WAIT)).unwrap();
    let start = |seq, phase| Announce {
        sender: 0xdead_beef,
        incarnation: 1,
        seq,
        phase,
        msg_id: 77,
        weight: 1.0,
        lookahead: None,
    };
    let good = Datagram::Announce(start(1, Phase::Start)).encode();
    let mut wrong_version = good.clone();
    wrong_version[2] = 9;
    let garbage: Vec<Vec<u8>> = vec![
        b"hello, DASR".to_vec(),
        Vec::new(),
        good[..good.len() - 3].to_vec(),
        vec![0xff; 500],
        {
            let mut g = good.clone();
            g[5] = 7; // unknown phase
            g
        },
    ];
    for g in &garbage {
        sock.send_to(g, raddr).unwrap();
    }
    sock.send_to(&wrong_version, raddr).unwrap();
    rx.wait_for("garbage counted", |v| {
        v["event"] == "metrics" && v["garbage"] == 5 && v["wrong_version"] == 1
    });

    // The receiver still answers a real announcement, and A's cap follows.
    let recv_ack = |sock: &UdpSocket| -> Ack {
        let mut buf = [0u8; 128];
        loop {
            let (n, _) = sock
                .recv_from(&mut buf)
                .expect("an ACK within the deadline");
            if let Ok(Datagram::Ack(k)) = Datagram::decode(&buf[..n]) {
                return k;
            }
        }
    };
    sock.send_to(&good, raddr).unwrap();
    let k = recv_ack(&sock);
    assert_eq!((k.n, k.cap, k.acked_seq, k.push), (2, R / 2.0, 1, false));
    a.wait_for("cap R/2", |v| is_cap(v, raddr, R / 2.0));
    sock.send_to(&Datagram::Announce(start(2, Phase::End)).encode(), raddr)
        .unwrap();
    let k = recv_ack(&sock);
    assert_eq!((k.n, k.acked_seq), (1, 2));
    a.wait_for("cap R again", |v| is_cap(v, raddr, R));
    rx.wait_for("final counters", |v| {
        v["event"] == "metrics"
            && v["garbage"] == 5
            && v["wrong_version"] == 1
            && v["starts"] == 2
            && v["ends"] == 1
    });
}
