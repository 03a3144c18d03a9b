//! The shim's connection to its host's `drum-agent`: registration on the agent's Unix
//! socket, the shared-memory table it gets back, and events sent to the agent. Owned by the
//! engine thread only. Every failure is a reason string: the caller runs the application
//! ungoverned (fail-open) and tries again later.

use drum_table::layout::Table;
use drum_table::mapping::{recv_with_fd, Mapping};
use drum_table::message::{AgentMsg, ShimMsg, MAX_LEN};
use drum_table::socket;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

/// Where the agent listens unless `DRUM_AGENT_SOCKET` says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/drum/shim.sock";
/// How long registration may take before the shim gives up (and retries later).
const WELCOME_TIMEOUT_MS: i32 = 1000;

pub struct Link {
    sock: OwnedFd,
    map: Mapping,
    pub app: String,
}

impl Link {
    /// Connects, registers with `hello` and maps the table the agent sends back.
    pub fn attach(path: &Path, hello: &ShimMsg) -> Result<Link, String> {
        let sock =
            socket::connect(path).map_err(|e| format!("connecting to {}: {e}", path.display()))?;
        send(&sock, hello)?;
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, WELCOME_TIMEOUT_MS) };
        if r <= 0 {
            return Err("the agent did not answer the registration".into());
        }
        let mut buf = [0u8; MAX_LEN];
        let (n, fd) = recv_with_fd(sock.as_raw_fd(), &mut buf)
            .map_err(|e| format!("reading the agent's answer: {e}"))?;
        if n == 0 {
            return Err("the agent closed the connection".into());
        }
        match AgentMsg::parse(&buf[..n]).map_err(|e| format!("bad answer from the agent: {e}"))? {
            AgentMsg::Refused { reason } => Err(format!("the agent refused: {reason}")),
            AgentMsg::Welcome { app } => {
                let fd = fd.ok_or("the agent's answer carried no table")?;
                let map = Mapping::open(fd.as_raw_fd())
                    .map_err(|e| format!("cannot map the agent's table: {e}"))?;
                map.table()
                    .check_header()
                    .map_err(|e| format!("the agent's table: {e}"))?;
                Ok(Link { sock, map, app })
            }
        }
    }

    pub fn table(&self) -> &Table {
        self.map.table()
    }

    /// Sends without blocking; `false` if the agent's socket would block or is gone.
    pub fn send(&self, m: &ShimMsg) -> bool {
        send(&self.sock, m).is_ok()
    }

    /// Has the agent closed the connection (it exited or was killed)?
    pub fn closed(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; zero timeout.
        let r = unsafe { libc::poll(&mut pfd, 1, 0) };
        if r <= 0 {
            return r < 0;
        }
        if pfd.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            return true;
        }
        // Nothing else is sent to the shim after the welcome: read and ignore it, so that a
        // chatty agent cannot fill the socket; 0 bytes is the end of the connection.
        let mut buf = [0u8; MAX_LEN];
        // SAFETY: reading into our buffer without blocking.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        n == 0
    }
}

fn send(sock: &OwnedFd, m: &ShimMsg) -> Result<(), String> {
    socket::send(sock.as_raw_fd(), m.encode().as_bytes()).map_err(|e| format!("send: {e}"))
}
