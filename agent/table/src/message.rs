//! Datagrams on the agent's registration socket (`SOCK_SEQPACKET`, so message boundaries are
//! kept and a half message never arrives). Each is one line of ASCII,
//! `DRUM1 <KIND> key=value …`, at most [`MAX_LEN`] bytes: readable with `strace`, cheap next
//! to a system call, and strictly parsed — an unknown version, kind or key, a missing or
//! malformed value is an error naming what was wrong.

pub const PROTOCOL: &str = "DRUM1";
pub const MAX_LEN: usize = 512;
const MAX_NAME: usize = 64;
const MAX_PATH: usize = 256;

/// From the shim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShimMsg {
    /// First datagram of a connection: who this is.
    Hello {
        pid: u32,
        app: String,
        exe: String,
    },
    /// A QP reached RTR towards `peer` (its GID) and remote QP `peer_qpn`.
    QpUp {
        qpn: u32,
        peer: [u8; 16],
        peer_qpn: u32,
    },
    QpGone {
        qpn: u32,
    },
    /// Long messages on this QP started (`busy`) or all ended: the AUSS announcements.
    Traffic {
        qpn: u32,
        busy: bool,
    },
    /// Bytes posted on this connected QP so far (cumulative): `out` to the peer (SEND,
    /// WRITE, atomics), `back` asked of it (RDMA READ lengths, whose data comes back). Sent
    /// periodically for the QPs whose counts changed; the agent turns them into the app's
    /// byte shares per receiver (the live problem's facility coefficients).
    Bytes {
        qpn: u32,
        out: u64,
        back: u64,
    },
}

/// From the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentMsg {
    /// Answer to `Hello`; the datagram carries the table's descriptor.
    Welcome {
        app: String,
    },
    Refused {
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

fn err<T>(s: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError(s.into()))
}

/// An app name: what operators write in configs, so kept to a safe alphabet.
pub fn valid_app(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The app identity for a process: `DRUM_APP` if valid, else the executable's file name
/// with every other character replaced by `_`.
pub fn app_identity(drum_app: Option<&str>, exe: &str) -> String {
    if let Some(a) = drum_app.filter(|a| valid_app(a)) {
        return a.to_string();
    }
    let base = exe.rsplit('/').next().unwrap_or("");
    let s: String = base
        .chars()
        .take(MAX_NAME)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "unknown".into()
    } else {
        s
    }
}

/// The IPv4 address in an IPv4-mapped GID (`::ffff:a.b.c.d`, RoCE v2 and softrnic).
pub fn ipv4_of_gid(g: &[u8; 16]) -> Option<std::net::Ipv4Addr> {
    (g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff)
        .then(|| std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
}

pub fn gid_of_ipv4(ip: std::net::Ipv4Addr) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&ip.octets());
    g
}

/// A GID as 32 hex digits (as messages and the agent's status carry it).
pub fn gid_hex(g: &[u8; 16]) -> String {
    g.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_gid(s: &str) -> Result<[u8; 16], ParseError> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return err(format!("peer {s:?} is not 32 hex digits"));
    }
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex checked");
    }
    Ok(g)
}

/// Path-like text on one line: whitespace and control characters become `_`.
fn one_token(s: &str, max: usize) -> String {
    s.chars()
        .take(max)
        .map(|c| {
            if c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

impl ShimMsg {
    pub fn encode(&self) -> String {
        match self {
            ShimMsg::Hello { pid, app, exe } => format!(
                "{PROTOCOL} HELLO pid={pid} app={} exe={}",
                one_token(app, MAX_NAME),
                one_token(exe, MAX_PATH)
            ),
            ShimMsg::QpUp {
                qpn,
                peer,
                peer_qpn,
            } => format!(
                "{PROTOCOL} QP qpn={qpn} peer={} peer_qpn={peer_qpn}",
                gid_hex(peer)
            ),
            ShimMsg::QpGone { qpn } => format!("{PROTOCOL} QPGONE qpn={qpn}"),
            ShimMsg::Traffic { qpn, busy } => format!(
                "{PROTOCOL} {} qpn={qpn}",
                if *busy { "BUSY" } else { "IDLE" }
            ),
            ShimMsg::Bytes { qpn, out, back } => {
                format!("{PROTOCOL} BYTES qpn={qpn} out={out} back={back}")
            }
        }
    }

    pub fn parse(b: &[u8]) -> Result<ShimMsg, ParseError> {
        let (kind, f) = fields(b)?;
        let m = match kind {
            "HELLO" => {
                let app = f.get("app")?;
                if !valid_app(app) {
                    return err(format!("app {app:?} is not a valid app name"));
                }
                ShimMsg::Hello {
                    pid: f.num("pid")?,
                    app: app.to_string(),
                    exe: f.get("exe")?.to_string(),
                }
            }
            "QP" => ShimMsg::QpUp {
                qpn: f.num("qpn")?,
                peer: parse_gid(f.get("peer")?)?,
                peer_qpn: f.num("peer_qpn")?,
            },
            "QPGONE" => ShimMsg::QpGone { qpn: f.num("qpn")? },
            "BUSY" | "IDLE" => ShimMsg::Traffic {
                qpn: f.num("qpn")?,
                busy: kind == "BUSY",
            },
            "BYTES" => ShimMsg::Bytes {
                qpn: f.num("qpn")?,
                out: f.num("out")?,
                back: f.num("back")?,
            },
            k => return err(format!("unknown message kind {k:?}")),
        };
        f.all_used()?;
        Ok(m)
    }
}

impl AgentMsg {
    pub fn encode(&self) -> String {
        match self {
            AgentMsg::Welcome { app } => format!("{PROTOCOL} WELCOME app={app}"),
            AgentMsg::Refused { reason } => {
                format!("{PROTOCOL} REFUSED reason={}", one_token(reason, MAX_PATH))
            }
        }
    }

    pub fn parse(b: &[u8]) -> Result<AgentMsg, ParseError> {
        let (kind, f) = fields(b)?;
        let m = match kind {
            "WELCOME" => AgentMsg::Welcome {
                app: f.get("app")?.to_string(),
            },
            "REFUSED" => AgentMsg::Refused {
                reason: f.get("reason")?.to_string(),
            },
            k => return err(format!("unknown message kind {k:?}")),
        };
        f.all_used()?;
        Ok(m)
    }
}

struct Fields<'a> {
    kv: Vec<(&'a str, &'a str)>,
    used: std::cell::Cell<usize>,
}

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Result<&'a str, ParseError> {
        let v = self
            .kv
            .iter()
            .find(|(key, _)| *key == k)
            .map(|(_, v)| *v)
            .ok_or_else(|| ParseError(format!("missing {k}=")))?;
        self.used.set(self.used.get() + 1);
        Ok(v)
    }

    fn num<T: std::str::FromStr>(&self, k: &str) -> Result<T, ParseError> {
        let v = self.get(k)?;
        v.parse()
            .map_err(|_| ParseError(format!("{k}={v:?} is not a valid number")))
    }

    fn all_used(&self) -> Result<(), ParseError> {
        if self.used.get() != self.kv.len() {
            return err(format!(
                "unexpected or repeated fields in {:?}",
                self.kv.iter().map(|(k, _)| *k).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }
}

fn fields(b: &[u8]) -> Result<(&str, Fields<'_>), ParseError> {
    if b.len() > MAX_LEN {
        return err(format!("message of {} bytes (limit {MAX_LEN})", b.len()));
    }
    let s = std::str::from_utf8(b).map_err(|_| ParseError("message is not UTF-8".into()))?;
    let mut words = s.split(' ');
    match words.next() {
        Some(PROTOCOL) => {}
        Some(v) if v.starts_with("DRUM") => return err(format!("unsupported protocol {v:?}")),
        _ => return err("not a DRUM message"),
    }
    let kind = words
        .next()
        .filter(|k| !k.is_empty())
        .ok_or(ParseError("no kind".into()))?;
    let mut kv = Vec::new();
    for w in words {
        let (k, v) = w
            .split_once('=')
            .ok_or_else(|| ParseError(format!("field {w:?} is not key=value")))?;
        if v.is_empty() {
            return err(format!("empty value for {k}"));
        }
        kv.push((k, v));
    }
    Ok((
        kind,
        Fields {
            kv,
            used: std::cell::Cell::new(0),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let g = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 2];
        for m in [
            ShimMsg::Hello {
                pid: 42,
                app: "kv-client".into(),
                exe: "/usr/bin/ib_write_bw".into(),
            },
            ShimMsg::QpUp {
                qpn: 17,
                peer: g,
                peer_qpn: 99,
            },
            ShimMsg::QpGone { qpn: 17 },
            ShimMsg::Traffic { qpn: 3, busy: true },
            ShimMsg::Traffic {
                qpn: 3,
                busy: false,
            },
            ShimMsg::Bytes {
                qpn: 3,
                out: u64::MAX,
                back: 0,
            },
        ] {
            assert_eq!(ShimMsg::parse(m.encode().as_bytes()), Ok(m));
        }
        for m in [
            AgentMsg::Welcome { app: "a".into() },
            AgentMsg::Refused {
                reason: "too_many".into(),
            },
        ] {
            assert_eq!(AgentMsg::parse(m.encode().as_bytes()), Ok(m));
        }
    }

    #[test]
    fn bad_messages_say_what_is_wrong() {
        let cases: [(&[u8], &str); 11] = [
            (b"", "not a DRUM"),
            (b"DRUM2 HELLO pid=1", "unsupported protocol"),
            (b"DRUM1 HELLO pid=x app=a exe=b", "pid=\"x\""),
            (b"DRUM1 HELLO pid=1 app=a/b exe=b", "valid app"),
            (b"DRUM1 HELLO pid=1 exe=b", "missing app="),
            (b"DRUM1 QP qpn=1 peer=zz peer_qpn=2", "32 hex"),
            (b"DRUM1 QPGONE qpn=1 extra=2", "unexpected"),
            (b"DRUM1 NOPE", "unknown message kind"),
            (b"DRUM1 BYTES qpn=1 out=-5 back=0", "out=\"-5\""),
            (b"DRUM1 BYTES qpn=1 out=5", "missing back="),
            (&[0xff, 0xfe], "UTF-8"),
        ];
        for (b, want) in cases {
            let e = ShimMsg::parse(b).unwrap_err().0;
            assert!(e.contains(want), "{:?}: {e}", String::from_utf8_lossy(b));
        }
        let long = vec![b'a'; MAX_LEN + 1];
        assert!(ShimMsg::parse(&long).unwrap_err().0.contains("limit"));
    }

    #[test]
    fn app_identity_prefers_drum_app_and_sanitises_the_executable() {
        assert_eq!(app_identity(Some("kv"), "/bin/x"), "kv");
        assert_eq!(
            app_identity(Some("bad name"), "/usr/bin/ib_write_bw"),
            "ib_write_bw"
        );
        assert_eq!(app_identity(None, "/opt/my app"), "my_app");
        assert_eq!(app_identity(None, ""), "unknown");
    }
}
