//! How the relay reaches its backends and its side application: [`Address`] (TCP or a Unix
//! socket), the [`Connector`] that hyper's pooled client dials through (a time limit on each
//! connect, `TCP_NODELAY`), and [`client`], that client.
//!
//! A Unix socket cannot be named by a URI, so [`Address::authority`] gives it a stand-in
//! authority, the path hex-encoded under `.unix.invalid` (a reserved name that no TCP host
//! has), which the connector decodes; hyper's pool keeps connections per authority, so each
//! address has a pool of its own.
//!
//! O(1) per connection besides the bytes moved; a connector is cloned into each connect and
//! holds no state beyond its time limit.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

/// Where a backend (or the side application) listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    /// A TCP host name or address and port.
    Tcp(String, u16),
    /// A Unix socket path.
    Unix(PathBuf),
}

const UNIX_SUFFIX: &str = ".unix.invalid";

impl Address {
    /// The authority of this address's URIs (see the module doc).
    pub fn authority(&self) -> String {
        match self {
            Address::Tcp(host, port) if host.contains(':') => format!("[{host}]:{port}"),
            Address::Tcp(host, port) => format!("{host}:{port}"),
            Address::Unix(path) => {
                let hex: String =
                    path.as_os_str().as_encoded_bytes().iter().map(|b| format!("{b:02x}")).collect();
                format!("{hex}{UNIX_SUFFIX}")
            }
        }
    }

    /// The address a URI made by [`Address::authority`] names.
    fn of(uri: &Uri) -> io::Result<Address> {
        let bad = || io::Error::new(io::ErrorKind::InvalidInput, format!("no address in {uri}"));
        let host = uri.host().ok_or_else(bad)?;
        if let Some(hex) = host.strip_suffix(UNIX_SUFFIX) {
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
                .collect::<Option<Vec<u8>>>()
                .ok_or_else(bad)?;
            return Ok(Address::Unix(PathBuf::from(String::from_utf8(bytes).map_err(|_| bad())?)));
        }
        let host = host.trim_start_matches('[').trim_end_matches(']');
        Ok(Address::Tcp(host.to_string(), uri.port_u16().unwrap_or(80)))
    }
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
    /// Connect to `address`, giving up after `limit`.
    pub async fn connect(address: &Address, limit: Duration) -> io::Result<Stream> {
        let connect = async {
            match address {
                Address::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
                Address::Tcp(host, port) => {
                    let s = TcpStream::connect((host.as_str(), *port)).await?;
                    s.set_nodelay(true)?;
                    Ok(Stream::Tcp(s))
                }
            }
        };
        tokio::time::timeout(limit, connect)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, data),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, data),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, data),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// Dials the address a URI names (see the module doc).
#[derive(Debug, Clone)]
pub struct Connector {
    limit: Duration,
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Stream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let limit = self.limit;
        Box::pin(async move { Ok(TokioIo::new(Stream::connect(&Address::of(&uri)?, limit).await?)) })
    }
}

/// The relay's HTTP client.
pub type HttpClient = Client<Connector, Full<Bytes>>;

/// hyper's client through a [`Connector`]: keep-alive connections per address, closed after
/// `idle` unused, when `pooled`; else a new connection for each request.
pub fn client(connect_limit: Duration, idle: Duration, pooled: bool) -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle)
        .pool_max_idle_per_host(if pooled { usize::MAX } else { 0 })
        .http1_max_headers(1000)
        .build(Connector { limit: connect_limit })
}

#[cfg(test)]
mod tests {
    use super::Address;

    #[test]
    fn addresses_survive_their_uris() {
        for a in [
            Address::Tcp("127.0.0.1".into(), 8000),
            Address::Tcp("::1".into(), 9),
            Address::Tcp("engine-3.local".into(), 80),
            Address::Unix("/tmp/kvroute proxy/side.sock".into()),
        ] {
            let uri: hyper::Uri = format!("http://{}/v1/models", a.authority()).parse().unwrap();
            assert_eq!(Address::of(&uri).unwrap(), a);
        }
    }
}
