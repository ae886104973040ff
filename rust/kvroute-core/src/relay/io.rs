//! Blocking sockets of the relay: one stream type for TCP and Unix-socket peers, connecting
//! with a time limit, and waiting for whichever of two sockets becomes readable first.
//!
//! Every wait is one `poll(2)` of at most two descriptors: O(1). Each value is owned by one
//! connection thread; nothing here is shared.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where a backend (or the side application) listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    /// A TCP host name or address and port.
    Tcp(String, u16),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(host, port) => write!(f, "{host}:{port}"),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// A connected stream socket.
#[derive(Debug)]
pub enum Stream {
    /// TCP, with `TCP_NODELAY` set.
    Tcp(TcpStream),
    /// A Unix stream socket.
    Unix(UnixStream),
}

impl Stream {
    /// Connect to `address`, giving up after `limit` (per resolved address for TCP).
    pub fn connect(address: &Address, limit: Duration) -> io::Result<Stream> {
        match address {
            Address::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path)?)),
            Address::Tcp(host, port) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, limit) {
                        Ok(s) => {
                            s.set_nodelay(true)?;
                            return Ok(Stream::Tcp(s));
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }

    /// Block in writes for at most `limit` (None: no limit).
    pub fn set_write_timeout(&self, limit: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(limit),
            Stream::Unix(s) => s.set_write_timeout(limit),
        }
    }

    /// Close both directions (wakes a thread blocked on this socket).
    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

/// What [`wait`] saw first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// The first descriptor has bytes (or an end or error) to read.
    First,
    /// The second one has.
    Second,
    /// Neither before the deadline.
    Timeout,
}

/// Wait until `first` or `second` (when given) is readable, or `deadline` passes. The
/// first descriptor wins a tie, so a peer's data is read before its partner's end.
pub fn wait(first: RawFd, second: Option<RawFd>, deadline: Instant) -> io::Result<Ready> {
    let events = libc::POLLIN;
    let mut fds = [
        libc::pollfd { fd: first, events, revents: 0 },
        libc::pollfd { fd: second.unwrap_or(-1), events, revents: 0 },
    ];
    let n: libc::nfds_t = if second.is_some() { 2 } else { 1 };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Ready::Timeout);
        }
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is a valid array of `n` pollfd structs that outlives the call.
        let got = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
        if got < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if fds[0].revents != 0 {
            return Ok(Ready::First);
        }
        if fds[1].revents != 0 {
            return Ok(Ready::Second);
        }
    }
}
