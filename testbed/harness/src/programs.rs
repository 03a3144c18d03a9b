//! Running the workloads' programs on emulated hosts: children with deadlines (a hung
//! program is killed, never waited for forever) and client/server pairs.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` with its output captured.
pub fn spawn(cmd: &mut Command) -> Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))
}

/// Waits for `child` at most `limit`, killing it past that; its output either way.
pub fn finish(mut child: Child, limit: Duration) -> Result<Output> {
    // Drained on their own threads: a chatty child must not block on a full pipe.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// Fails with the program's output unless it succeeded.
pub fn check(o: &Output, what: &str) -> Result<()> {
    if !o.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}

/// How long a server may take to listen: its start under the shim (registration, opening
/// the device) on a loaded machine.
pub const LISTEN_LIMIT: Duration = Duration::from_secs(30);

/// Waits until `server` listens on TCP `port` in its network namespace (its
/// `/proc/PID/net/tcp`): perftest's clients do not retry a server that does not listen yet,
/// and a fixed 400 ms wait failed a governed victim's connection on a loaded machine.
pub fn await_listening(server: &mut Child, port: u16, limit: Duration) -> Result<()> {
    let pid = server.id();
    let t = std::time::Instant::now();
    loop {
        let listening = ["tcp", "tcp6"].iter().any(|f| {
            std::fs::read_to_string(format!("/proc/{pid}/net/{f}"))
                .is_ok_and(|table| listens_on(&table, port))
        });
        if listening {
            return Ok(());
        }
        if let Some(status) = server.try_wait()? {
            bail!("the server (pid {pid}) exited ({status}) before it listened on port {port}");
        }
        if t.elapsed() >= limit {
            bail!("the server (pid {pid}) did not listen on TCP port {port} within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a `/proc/net/tcp` table has a socket listening (state `0A`) on `port`.
fn listens_on(table: &str, port: u16) -> bool {
    let want = format!(":{port:04X}");
    table.lines().skip(1).any(|row| {
        let mut fields = row.split_whitespace().skip(1);
        let local = fields.next().unwrap_or("");
        let state = fields.nth(1).unwrap_or("");
        state == "0A" && local.ends_with(&want)
    })
}

/// A server started first and a client run against it once the server listens on `port`
/// (perftest's pattern): the client's output, after both succeeded.
pub fn pair(
    server: &mut Command,
    port: u16,
    client: &mut Command,
    limit: Duration,
) -> Result<Output> {
    let mut s = spawn(server)?;
    if let Err(e) = await_listening(&mut s, port, LISTEN_LIMIT) {
        let _ = s.kill();
        let _ = s.wait();
        return Err(e);
    }
    let c = finish(spawn(client)?, limit)?;
    let s = finish(s, Duration::from_secs(10))?;
    check(&c, "client")?;
    check(&s, "server")?;
    Ok(c)
}

/// The one-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_found_in_a_proc_net_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:4853 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
   1: 0100007F:4854 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n";
        assert!(listens_on(table, 0x4853));
        assert!(!listens_on(table, 0x4854), "established, not listening");
        assert!(!listens_on(table, 0x853), "a port is matched whole");
    }

    #[test]
    fn a_server_that_exits_before_it_listens_is_an_error_not_a_wait() {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let t = std::time::Instant::now();
        let e = await_listening(&mut c, 1, Duration::from_secs(20)).unwrap_err();
        assert!(e.to_string().contains("exited"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_real_listener_is_found() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // this process listens: a child in the same namespace reads the same table
        let mut c = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let r = await_listening(&mut c, port, Duration::from_secs(5));
        let _ = c.kill();
        let _ = c.wait();
        r.unwrap();
    }
}
