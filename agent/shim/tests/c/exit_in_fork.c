/* A program that calls exit() from a signal handler, as qperf's server does on SIGQUIT, with
 * the signal timed to land while fork() runs the shim's fork handlers: it forks children that
 * exit at once, over and over, until a one-shot timer of USEC microseconds fires; a signal
 * raised during the clone system call is delivered as it returns, before the fork handlers
 * have released the shim's locks. Exits 0 from the handler; 1 if the timer never fired.
 * Usage: exit_in_fork USEC */
#include <signal.h>
#include <stdlib.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_alarm(int s) { (void)s; exit(0); }

int main(int argc, char **argv) {
	long usec = argc > 1 ? atol(argv[1]) : 3000;
	struct itimerval t = { { 0, 0 }, { usec / 1000000, usec % 1000000 } };
	signal(SIGALRM, on_alarm);
	setitimer(ITIMER_REAL, &t, 0);
	for (int i = 0; i < 1000000; i++) {
		pid_t p = fork();
		if (p == 0) _exit(0);
		if (p > 0) waitpid(p, 0, 0);
	}
	return 1;
}
