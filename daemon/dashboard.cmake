# dashboard.cmake - embeds the dashboard page and Chart.js into the daemon at build time.
#
# Chart.js comes from the Debian package libjs-chart.js (never fetched at run time, never copied
# into the repository); the page sources are daemon/dashboard/*. The result is the static
# library tkvd_dashboard, which whatever links daemon/http.c must link too.
set(TKVD_CHARTJS "" CACHE FILEPATH "Chart.js UMD build embedded into the dashboard (libjs-chart.js)")
if(NOT TKVD_CHARTJS)
  # Chart.js 4 ships chart.umd.js; the 3.x package in Debian 12 ships chart.min.js.
  foreach(cand /usr/share/javascript/chart.js/chart.umd.js /usr/share/javascript/chart.js/chart.min.js)
    if(EXISTS ${cand})
      set(TKVD_CHARTJS ${cand} CACHE FILEPATH "Chart.js UMD build embedded into the dashboard (libjs-chart.js)" FORCE)
      break()
    endif()
  endforeach()
endif()
if(NOT TKVD_CHARTJS OR NOT EXISTS ${TKVD_CHARTJS})
  message(FATAL_ERROR "Chart.js not found: install libjs-chart.js (scripts/install-deps) or set TKVD_CHARTJS")
endif()

set(TKVD_DASH_DIR ${CMAKE_CURRENT_LIST_DIR}/dashboard)
set(TKVD_DASH_C ${CMAKE_CURRENT_BINARY_DIR}/tkvd_dashboard_assets.c)
set(TKVD_DASH_FILES ${TKVD_DASH_DIR}/index.html ${TKVD_DASH_DIR}/dashboard.js
    ${TKVD_DASH_DIR}/style.css ${TKVD_CHARTJS})
add_custom_command(OUTPUT ${TKVD_DASH_C}
  COMMAND ${CMAKE_COMMAND} -DOUT=${TKVD_DASH_C}
          "-DASSETS=index_html=${TKVD_DASH_DIR}/index.html|dashboard_js=${TKVD_DASH_DIR}/dashboard.js|style_css=${TKVD_DASH_DIR}/style.css|chart_js=${TKVD_CHARTJS}"
          -P ${TKVD_DASH_DIR}/embed.cmake
  DEPENDS ${TKVD_DASH_FILES} ${TKVD_DASH_DIR}/embed.cmake
  COMMENT "Embedding the dashboard page and Chart.js" VERBATIM)
add_library(tkvd_dashboard STATIC ${TKVD_DASH_C})

# Link it into the daemon target when daemon/CMakeLists.txt names it before including us.
if(DEFINED TKVD_CORE_TARGET AND TARGET ${TKVD_CORE_TARGET})
  target_link_libraries(${TKVD_CORE_TARGET} PRIVATE tkvd_dashboard PkgConfig::MHD)
endif()
