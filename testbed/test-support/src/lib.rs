//! What the tests of softrnic and the shim share: child processes with deadlines (a hung
//! child is killed, never waited for forever), the checks that decide whether a test can run
//! here (root, namespaces, installed tools) or must say why it skips, and the check of
//! hand-declared C layouts against the installed `<infiniband/verbs.h>`.

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Is `tool` on the `PATH`?
pub fn have(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

/// A perftest program's command line for softrnic: `tool`, then `-x 0` (softrnic's RoCE port
/// has its one GID at index 0, which perftest must be told on RoCE), then `-F` (perftest exits
/// 1 with "Correlation coefficient r^2 < 0.9 / Can't produce a report" when its cycle-counter
/// calibration fails on a loaded machine, which says nothing about the NIC; `-F` keeps it
/// running), then `args`.
pub fn perftest<'a>(tool: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut line = vec![tool, "-x", "0", "-F"];
    line.extend_from_slice(args);
    line
}

/// A binary of the workspace's build: integration tests run from `target/*/deps`, the
/// binaries sit one directory up.
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("a test binary sits in target/PROFILE/deps")
        .join(name)
}

/// A directory under the system's temporary directory, named after `prefix` and this process,
/// removed with its contents when dropped.
pub struct Scratch(pub std::path::PathBuf);

impl Scratch {
    pub fn new(prefix: &str) -> Scratch {
        Scratch(std::env::temp_dir().join(format!("{prefix}-{}", std::process::id())))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Can softrnic run here: root, mount and network namespaces, and `tools` installed?
/// `Err` says why not.
pub fn privileged(tools: &[&str]) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root: softrnic needs mount/network namespaces".into());
    }
    let ok = Command::new("unshare")
        .args(["-m", "-n", "true"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        return Err("cannot create mount/network namespaces here".into());
    }
    for tool in tools {
        if !have(tool) {
            return Err(format!(
                "{tool} not installed (apt-get install ibverbs-utils iproute2)"
            ));
        }
    }
    Ok(())
}

/// Files that unmodified programs create at fixed paths (`ibv_xsrq_pingpong`'s and perftest's
/// XRC domain files in /tmp): those that did not exist when the guard was made are removed
/// when it is dropped, so a test leaves nothing behind and never deletes a file it found.
pub struct CreatedFiles(Vec<&'static str>);

impl CreatedFiles {
    pub fn watch(paths: &[&'static str]) -> CreatedFiles {
        CreatedFiles(
            paths
                .iter()
                .copied()
                .filter(|p| !std::path::Path::new(p).exists())
                .collect(),
        )
    }
}

impl Drop for CreatedFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The files `ibv_xsrq_pingpong` and perftest's `-c XRC` open their XRC domains through.
pub const XRC_DOMAIN_FILES: [&str; 3] = [
    "/tmp/xrc_domain",
    "/tmp/xrc_domain_server",
    "/tmp/xrc_domain_client",
];

/// Status, stdout and stderr, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Starts `c` with stdin closed and stdout/stderr captured.
pub fn spawn(c: &mut Command) -> Child {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn")
}

/// Whether a client failed only because its server does not listen yet: its TCP exchange
/// (ibverbs-utils, perftest) was refused, or its RDMA CM connection was rejected for want of a
/// listener (`rping`, `ucmatose`: "RDMA_CM_EVENT_REJECTED, error 8"; not perftest's
/// post-handshake rejection, see [`perftest_cm_listen_race`]).
pub fn server_not_listening_yet(client: &Output) -> bool {
    let all = text(client);
    [
        "Couldn't connect",
        "Unable to init the socket",
        "RDMA_CM_EVENT_REJECTED, error",
        "rdma_connect: Connection refused",
    ]
    .iter()
    .any(|m| all.contains(m))
}

/// perftest with `-R` connects its data QPs right after a handshake with its server, which
/// only then starts to listen: a client that wins that race is rejected (no listener: reason
/// 8 for RC; for UD the SIDR status "unsupported", 1), as it would be on a NIC, and perftest
/// 4.5's retry path then uses the ids it has just destroyed and crashes. A test that sees
/// this in a client's output runs both sides again.
pub fn perftest_cm_listen_race(client: &Output) -> bool {
    let all = text(client);
    !client.status.success()
        && (all.contains("Event: RDMA_CM_EVENT_REJECTED; error: 8")
            || all.contains("Event: RDMA_CM_EVENT_UNREACHABLE; error: 1."))
}

/// Waits until `server` listens on TCP `port` in its own network namespace (its
/// `/proc/PID/net/tcp{,6}`), instead of sleeping a guessed while before starting its client:
/// a loaded machine starts a program under `softrnic exec` and the shim late, and perftest's
/// client does not retry. The port must not be listened on in the namespace the server
/// starts from (the root one), which holds for the emulated hosts' ports of these tests.
/// Panics, naming the port, when the server exits or `limit` passes first.
pub fn wait_listening(server: &mut Child, port: u16, limit: Duration) {
    let pid = server.id();
    let t = Instant::now();
    loop {
        let listening = ["tcp", "tcp6"].iter().any(|f| {
            std::fs::read_to_string(format!("/proc/{pid}/net/{f}"))
                .is_ok_and(|table| listens_on(&table, port))
        });
        if listening {
            return;
        }
        if let Ok(Some(status)) = server.try_wait() {
            panic!("the server (pid {pid}) exited ({status}) before it listened on port {port}");
        }
        assert!(
            t.elapsed() < limit,
            "the server (pid {pid}) did not listen on TCP port {port} within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a `/proc/net/tcp` (or `tcp6`) table has a socket listening on `port`: a row whose
/// local address ends in the port in hex and whose state is `0A` (LISTEN).
fn listens_on(table: &str, port: u16) -> bool {
    table.lines().skip(1).any(|row| {
        let mut fields = row.split_whitespace().skip(1);
        let local = fields.next().unwrap_or("");
        let state = fields.nth(1).unwrap_or("");
        state == "0A"
            && local
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// A file its writer replaces by a rename (a status or counters file), with the time it was
/// written: its modification time, from the same open file as the text. A rate is the
/// difference of two such readings over the difference of their times, not over the time the
/// test slept between them: a writer that runs every 100–200 ms, later on a loaded machine,
/// makes the slept time off by up to that much.
pub fn read_written(path: &std::path::Path) -> Option<(String, std::time::SystemTime)> {
    let mut file = std::fs::File::open(path).ok()?;
    let written = file.metadata().ok()?.modified().ok()?;
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    Some((text, written))
}

/// Waits for a child with a deadline; kills it when the deadline passes.
pub fn wait_timeout(mut child: Child, limit: Duration) -> Output {
    let t = Instant::now();
    let mut out = child.stdout.take().expect("stdout captured");
    let mut err = child.stderr.take().expect("stderr captured");
    let ro = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let re = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            break child.wait().expect("wait after kill");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: ro.join().unwrap_or_default(),
        stderr: re.join().unwrap_or_default(),
    }
}

/// Runs `c` to completion, or kills it after `limit`.
pub fn run_timeout(c: &mut Command, limit: Duration) -> Output {
    wait_timeout(spawn(c), limit)
}

/// The counters `softrnic stats HOST` printed by the command `c` (one `name value` per
/// line).
pub fn softrnic_stats(c: &mut Command) -> std::collections::HashMap<String, u64> {
    let out = run_timeout(c, Duration::from_secs(10));
    assert!(out.status.success(), "stats failed: {}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// Compiles a C probe against the installed `<infiniband/verbs.h>` and asserts that every
/// `(name, value)` of `checks` equals what C says. Names: `sizeof S` (`sizeof(struct S)`),
/// `S.f` (`offsetof(struct S, f)`), and `back verbs_context.f` (bytes from `f` to the
/// embedded `ibv_context`, which the extended context precedes).
pub fn assert_c_layout(checks: &[(&str, usize)]) {
    assert_c_layout_with(&["infiniband/verbs.h"], checks);
}

/// [`assert_c_layout`] against other installed headers (`<h>` for each of `headers`).
pub fn assert_c_layout_with(headers: &[&str], checks: &[(&str, usize)]) {
    let mut c: String = headers
        .iter()
        .map(|h| format!("#include <{h}>\n"))
        .collect();
    c.push_str("#include <stdio.h>\n#include <stddef.h>\nint main(void){\n");
    for (name, _) in checks {
        let expr = if let Some(t) = name.strip_prefix("sizeof ") {
            format!("sizeof(struct {t})")
        } else if let Some(f) = name.strip_prefix("back verbs_context.") {
            format!("offsetof(struct verbs_context, context) - offsetof(struct verbs_context, {f})")
        } else {
            let (s, f) = name
                .split_once('.')
                .expect("a check is `sizeof S` or `S.field`");
            format!("offsetof(struct {s}, {f})")
        };
        c.push_str(&format!("printf(\"%zu\\n\", (size_t){expr});\n"));
    }
    c.push_str("return 0;}\n");
    let dir = std::env::temp_dir().join(format!(
        "drum-layout-probe-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("probe directory");
    let src = dir.join("probe.c");
    let bin = dir.join("probe");
    std::fs::write(&src, c).expect("probe source");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("a C compiler (cc) is needed for the layout probe");
    assert!(
        st.success(),
        "probe failed to compile (is libibverbs-dev installed?)"
    );
    let out = Command::new(&bin).output().expect("run the probe");
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    let got: Vec<usize> = text.lines().filter_map(|l| l.parse().ok()).collect();
    assert_eq!(got.len(), checks.len(), "probe output: {text}");
    let bad: Vec<String> = checks
        .iter()
        .zip(got)
        .filter(|((_, rust), c)| rust != c)
        .map(|((name, rust), c)| format!("{name}: rust {rust} != C {c}"))
        .collect();
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_found_by_its_port_and_state() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: 00000000:4A6B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
             1: 0100007F:48B8 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n";
        assert!(listens_on(table, 0x4A6B));
        // Connected, not listening.
        assert!(!listens_on(table, 0x48B8));
        assert!(!listens_on(table, 18515));
        let v6 = "  sl  local_address                         remote_address                        st\n\
             0: 00000000000000000000000000000000:4A6B 00000000000000000000000000000000:0000 0A 0\n";
        assert!(listens_on(v6, 0x4A6B));
    }

    #[test]
    fn a_real_listener_is_waited_for() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // A stand-in server process that shares our namespace: the table is this process's.
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        wait_listening(&mut child, port, Duration::from_secs(5));
        drop(listener);
        // Port 0, which no socket listens on: the port just closed could be bound again by
        // anything else in the namespace (CI once found it listened on 100 ms later).
        let gone = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_listening(&mut child, 0, Duration::from_millis(100))
        }));
        let _ = child.kill();
        let _ = child.wait();
        assert!(gone.is_err(), "no listener: the wait must fail");
    }

    #[test]
    fn a_perftest_line_is_tool_gid_index_0_no_calibration_check_then_args() {
        assert_eq!(
            perftest("ib_write_bw", &["-s", "4096", "-n", "300"]),
            ["ib_write_bw", "-x", "0", "-F", "-s", "4096", "-n", "300"]
        );
        assert_eq!(
            perftest("ib_send_lat", &[]),
            ["ib_send_lat", "-x", "0", "-F"]
        );
    }

    #[test]
    fn a_child_past_its_deadline_is_killed() {
        let t = Instant::now();
        let o = run_timeout(Command::new("sleep").arg("30"), Duration::from_millis(200));
        assert!(!o.status.success());
        assert!(t.elapsed() < Duration::from_secs(5));
        let o = run_timeout(Command::new("echo").arg("hi"), Duration::from_secs(10));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "hi\n", "{}", text(&o));
        assert!(have("sh") && !have("no-such-tool-here"));
    }
}
